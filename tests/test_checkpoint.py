"""Checkpoints: DCP save at world W, load at world W' (resharding) bit-exact, with Adam moments; full state
dicts on rank 0 only; DTensor round trips; mismatched checkpoints name the parameter."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardtensor
from rank_pool import run_on_ranks


def _model(seed: int) -> nn.Module:
    # Rows 7, 5, 3 and 1: not divisible by 2 or 4, so shards are padded and some ranks hold no rows.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3),
                         nn.Linear(3, 1))


def _train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full_optimizer_state(model, opt) -> dict:
    """Every rank: {name: {key: full tensor}} gathered from the shards."""
    sd = shardtensor.sharded_optimizer_state_dict(model, opt)
    out = {}
    for name, values in sd["state"].items():
        out[name] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in values.items()}
    return out


def save_case(path: str, seed: int) -> dict:
    model = shardtensor.shard_module(_model(seed))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed)
    shardtensor.save_checkpoint(path, model, opt)
    return {"model": shardtensor.full_state_dict(model), "optim": _full_optimizer_state(model, opt)}


def load_case(path: str, seed: int) -> dict:
    model = shardtensor.shard_module(_model(seed + 1))  # different values: the load must overwrite them
    opt = torch.optim.Adam(model.parameters(), lr=0.5)  # different lr: restored from the checkpoint
    shardtensor.load_checkpoint(path, model, opt)
    loaded = {"model": shardtensor.full_state_dict(model), "optim": _full_optimizer_state(model, opt),
              "lr": opt.param_groups[0]["lr"]}
    _train(model, opt, 1, seed + 7)  # training continues from the loaded state
    loaded["after"] = shardtensor.full_state_dict(model)
    return loaded


@pytest.mark.parametrize("save_world,load_world", [(2, 4), (4, 2), (2, 1)])
def test_dcp_checkpoint_reshards_bit_exact(tmp_path, save_world, load_world):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(save_world, save_case, path, 3)[0]
    loaded = run_on_ranks(load_world, load_case, path, 3)
    for rank_result in loaded:
        assert rank_result["lr"] == 1e-2
        for key, value in saved["model"].items():
            assert torch.equal(rank_result["model"][key], value), key
        assert saved["optim"].keys() == rank_result["optim"].keys()
        for name, values in saved["optim"].items():
            for k, v in values.items():
                assert torch.equal(rank_result["optim"][name][k], v), (name, k)
    # The same continuation from the same state gives the same parameters, whichever world loaded it.
    if load_world != save_world:
        again = run_on_ranks(save_world, load_case, path, 3)[0]
        for key, value in again["after"].items():
            torch.testing.assert_close(loaded[0]["after"][key], value, rtol=1e-6, atol=1e-7)


def mismatch_case(path: str, kind: str) -> str:
    if kind == "save":
        shardtensor.save_checkpoint(path, shardtensor.shard_module(_model(0)))
        return ""
    torch.manual_seed(0)
    if kind == "shape":
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.LayerNorm(5), nn.Linear(5, 3),
                              nn.Linear(3, 1))
    else:
        model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3),
                              nn.Linear(3, 1), nn.Linear(1, 2))
    try:
        shardtensor.load_checkpoint(path, shardtensor.shard_module(model))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mismatched_checkpoint_names_the_parameter(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, mismatch_case, path, "save")
    shape_msg = run_on_ranks(2, mismatch_case, path, "shape")[0]
    assert "'model.0.weight'" in shape_msg and "(7, 6)" in shape_msg and "(8, 6)" in shape_msg, shape_msg
    key_msg = run_on_ranks(2, mismatch_case, path, "key")[0]
    assert "'model.6.weight'" in key_msg and "not in the checkpoint" in key_msg, key_msg


def rank0_case(seed: int) -> tuple:
    model = shardtensor.shard_module(_model(seed))
    sd = shardtensor.full_state_dict(model, rank0_only=True)
    return torch.distributed.get_rank(), sd


def test_full_state_dict_rank0_only():
    reference = _model(5).state_dict()
    results = run_on_ranks(2, rank0_case, 5)
    for rank, sd in results:
        if rank == 0:
            assert sd.keys() == reference.keys()
            for key, value in reference.items():
                assert torch.equal(sd[key], value), key
        else:
            assert sd == {}


def dtensor_case(rows: int) -> tuple:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    p = shardtensor.ShardedParam.from_full(full, name="w")
    d = p.to_dtensor()
    back = shardtensor.ShardedParam.from_dtensor(d)
    mesh = d.device_mesh
    replicated = shardtensor.ShardedParam.from_dtensor(distribute_tensor(full, mesh, [Replicate()]))
    reference_dt = distribute_tensor(full, mesh, [Shard(0)])  # torch's own split of the same tensor
    try:
        shardtensor.ShardedParam.from_dtensor(distribute_tensor(full, mesh, [Shard(1)]))
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    torch_split_equal = torch.equal(reference_dt.to_local(), d.to_local())
    back_equal = torch.equal(back.full_tensor(), full) and torch.equal(back.to_local(), p.to_local())
    replicated_equal = torch.equal(replicated.to_local(), p.to_local())
    d.to_local().add_(1)  # a view of the shard: writes land in the ShardedParam
    return (torch.equal(d.full_tensor(), full + 1), back_equal, replicated_equal, torch_split_equal,
            torch.equal(p.full_tensor(), full + 1), refused)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dtensor_round_trip(world):
    for rows in (5, 1, 8):
        for result in run_on_ranks(world, dtensor_case, rows):
            dt_full, back_full, replicated_equal, torch_split_equal, view_writes, refused = result
            assert dt_full and back_full and replicated_equal and torch_split_equal and view_writes
            assert "Shard(dim=1)" in refused and "redistribute" in refused


def dtensor_state_dict_case(how: str) -> dict:
    """FSDP2's resume recipe with shardtensor's DTensor state dict: ``set_model_state_dict(model, sd)`` with
    ``sd = sharded_state_dict(other)`` (``Shard(0)`` DTensors), the same with ``Replicate()`` DTensors, or one of
    another shape, or on another mesh."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    source, target = shardtensor.shard_module(_model(1)), shardtensor.shard_module(_model(2))
    sd = shardtensor.sharded_state_dict(source)
    mesh = sd["0.weight"].device_mesh
    if how == "replicated":
        sd = {k: distribute_tensor(v.full_tensor(), mesh, [Replicate()]) for k, v in sd.items()}
    elif how == "another shape":
        sd["2.weight"] = distribute_tensor(torch.zeros(4, 7), mesh, [Shard(0)])
    elif how == "shard(1)":
        sd["2.weight"] = distribute_tensor(sd["2.weight"].full_tensor(), mesh, [Shard(1)])
    before = {k: v.clone() for k, v in shardtensor.full_state_dict(target).items()}
    try:
        set_model_state_dict(target, sd)
        message = "no error"
    except (ValueError, RuntimeError) as exc:  # (another shape: torch's size-mismatch error, on every rank)
        message = f"{type(exc).__name__}: {exc}"
    after = shardtensor.full_state_dict(target)
    wanted = shardtensor.full_state_dict(source) if message == "no error" else before
    target(torch.randn(3, 6)).sum().backward()  # every rank goes on to the same collectives
    return {"message": message, "rank": dist.get_rank(),
            "equal": all(torch.equal(after[k], wanted[k]) for k in wanted)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["shard(0)", "replicated", "another shape", "shard(1)"])
def test_set_model_state_dict_takes_dtensor_state_dicts_or_names_them_on_every_rank(world, how):
    """``set_model_state_dict(model, shardtensor.sharded_state_dict(other))`` (FSDP2's get / dcp.load / set
    recipe) raised torch's "got mixed torch.Tensor and DTensor" on the ranks holding rows, and went through on a
    rank holding none: at world 4 the next collective met ranks that had gone on (helper 18).  A Shard(0) or
    Replicate() DTensor now loads as the parameter's rows; another shape or placement is refused on every rank,
    naming the key, with nothing copied."""
    for out in run_on_ranks(world, dtensor_state_dict_case, how, timeout=120):
        assert out["equal"], out
        if how in ("shard(0)", "replicated"):
            assert out["message"] == "no error", out
        else:
            assert "2.weight" in out["message"] and "Nothing was copied" in out["message"], out
            assert ("ValueError: load_state_dict: '2.weight' is a DTensor" in out["message"]) == (how == "shard(1)")


def save_between_micro_batches_case(root: str, save: bool) -> dict:
    """A fresh optimizer, one ``gradient_sync(model, False)`` micro-batch, ``save_checkpoint`` (or not), the synced
    micro-batch and a step: the parameters after it."""
    import os

    model = shardtensor.shard_module(_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    with shardtensor.gradient_sync(model, False):
        model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
    if save:
        shardtensor.save_checkpoint(os.path.join(root, "ckpt"), model, opt)
    model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
    opt.step()
    return {k: v.clone() for k, v in shardtensor.full_state_dict(model).items()}


def test_a_save_between_micro_batches_before_the_first_step_saves_and_changes_nothing(tmp_path):
    """``save_checkpoint(path, model, opt)`` between ``no_sync`` micro-batches with an optimizer that has not
    stepped was refused with "AdamW.step(): the gradient is still deferred", naming a step the user never took
    (the step at lr 0 torch's ``get_optimizer_state_dict`` takes to make state; helper 18).  It saves now, and
    the step after the synced micro-batch equals the one of a run that did not save."""
    saved = run_on_ranks(2, save_between_micro_batches_case, str(tmp_path), True, timeout=120)
    plain = run_on_ranks(2, save_between_micro_batches_case, str(tmp_path), False, timeout=120)
    assert (tmp_path / "ckpt" / ".metadata").exists()
    for key in plain[0]:
        assert torch.equal(saved[0][key], plain[0][key]), key


def dtensor_optimizer_resume_case(root: str, how: str, kind: str) -> dict:
    """FSDP2's resume recipe over shardtensor's DTensor dicts: ``sd = {"model": sharded_state_dict(m), "optim":
    sharded_optimizer_state_dict(m, opt)}``, ``dcp.load(sd)``, ``set_optimizer_state_dict``; or that dict of a
    fresh optimizer only saved.  The parameters after the steps that follow."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    def dicts(model, opt):
        return {"model": shardtensor.sharded_state_dict(model),
                "optim": shardtensor.sharded_optimizer_state_dict(model, opt)}

    def optimizer(model):  # (SGD's dampened momentum steps zero state otherwise than none)
        return (torch.optim.Adam(model.parameters(), lr=0.05) if kind == "Adam" else
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.5))

    path = os.path.join(root, f"ckpt-{kind}")
    model = shardtensor.shard_module(_model(0))
    opt = optimizer(model)
    if how == "uninterrupted":
        _train(model, opt, 2, seed=1)
        opt.param_groups[0]["lr"] = 0.02
        _train(model, opt, 2, seed=2)
    elif how == "fresh, saved only":  # must leave training as it was
        dcp.save(dicts(model, opt), checkpoint_id=path + "-fresh")
        _train(model, opt, 2, seed=1)
        opt.param_groups[0]["lr"] = 0.02
        _train(model, opt, 2, seed=2)
    else:  # resume (into a fresh optimizer, or one that stepped since)
        _train(model, opt, 2, seed=1)
        opt.param_groups[0]["lr"] = 0.02
        dcp.save(dicts(model, opt), checkpoint_id=path)
        model = shardtensor.shard_module(_model(5))
        opt = optimizer(model)
        if how == "resume, stepped optimizer":
            _train(model, opt, 1, seed=9)
        sd = dicts(model, opt)
        dcp.load(sd, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, sd["optim"])
        _train(model, opt, 2, seed=2)
    return shardtensor.full_state_dict(model)


@pytest.mark.parametrize("kind", ["Adam", "SGD"])
@pytest.mark.parametrize("world", [2, 4])
def test_resume_through_dtensor_state_dicts_equals_the_uninterrupted_run(tmp_path, world, kind):
    """``sharded_optimizer_state_dict`` of a fresh optimizer had no state for ``dcp.load`` to fill, so a resume
    through it loaded nothing (0.26 off the uninterrupted run after two steps), and ``set_optimizer_state_dict``
    with its DTensors failed at the next step with torch's "mixed torch.Tensor and DTensor" (helper 18).  Now a
    resume into a fresh or a stepped optimizer equals the uninterrupted run, learning rate included, and the dict
    of a fresh optimizer taken only to be saved leaves training as it was."""
    runs = {how: run_on_ranks(world, dtensor_optimizer_resume_case, str(tmp_path), how, kind, timeout=180)[0]
            for how in ("uninterrupted", "fresh, saved only", "resume, fresh optimizer", "resume, stepped optimizer")}
    for how, params in runs.items():
        for key, value in runs["uninterrupted"].items():
            assert torch.allclose(params[key], value, rtol=0, atol=1e-6), (how, key)


def regionally_compiled_keys_case() -> dict:
    """``model[i] = torch.compile(model[i])`` after shard_module (never run: no compilation), then a full state
    dict round trip with the plain model."""
    torch.manual_seed(0)
    plain = _model(0)
    model = shardtensor.shard_module(_model(0))
    model[0] = torch.compile(model[0])
    model[2] = torch.compile(model[2])
    full = shardtensor.full_state_dict(model)
    other = _model(7)
    other.load_state_dict(full)  # the plain model takes the export
    shardtensor.load_full_state_dict(model, other.state_dict())  # and the sharded one takes a plain checkpoint
    torch_keys = {k.replace("0.", "0._orig_mod.", 1) if k.startswith("0.") else k: v for k, v in full.items()}
    shardtensor.load_full_state_dict(model, torch_keys)  # (model.state_dict()'s keys, with _orig_mod.)
    shardtensor.load_full_state_dict(model, other.state_dict())
    back = shardtensor.full_state_dict(model)
    return {"keys": sorted(full) == sorted(plain.state_dict()),
            "equal": all(torch.equal(back[k], v) for k, v in other.state_dict().items())}


def test_full_state_dict_of_regionally_compiled_blocks_has_the_plain_models_keys():
    """Blocks compiled by assignment (``model.blocks[i] = torch.compile(block)``) kept ``_orig_mod.`` in
    ``full_state_dict``'s keys: the plain model refused the export (missing keys) and ``load_full_state_dict``
    refused the plain model's checkpoint (helper 21).  Both load now."""
    for out in run_on_ranks(2, regionally_compiled_keys_case, timeout=120):
        assert out == {"keys": True, "equal": True}, out


def scheduler_built_after_the_load_case(root: str) -> dict:
    """Save with a LambdaLR; resume into a fresh optimizer, then build the scheduler with ``last_epoch``."""
    import os

    path = os.path.join(root, "ckpt")
    model = shardtensor.shard_module(_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    for _ in range(2):
        _train(model, opt, 1, seed=1)
        sched.step()
    shardtensor.save_checkpoint(path, model, opt)
    fresh = shardtensor.shard_module(_model(0))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    shardtensor.load_checkpoint(path, fresh, opt2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1 / (s + 1), last_epoch=1)
    return {"initial_lr": opt2.param_groups[0].get("initial_lr"), "lr": opt2.param_groups[0]["lr"],
            "last_epoch": sched2.last_epoch}


def test_initial_lr_saved_in_a_checkpoint_is_restored_into_a_fresh_optimizer(tmp_path):
    """``load_checkpoint`` into a fresh optimizer dropped the saved ``initial_lr``, so a scheduler built after the
    load with ``last_epoch=k`` (the common resume; transformers' schedules take it too) raised torch's "param
    'initial_lr' is not specified", where DDP's ``opt.load_state_dict`` restores it (helper 22)."""
    for out in run_on_ranks(2, scheduler_built_after_the_load_case, str(tmp_path), timeout=120):
        assert out["initial_lr"] == 0.01 and out["last_epoch"] == 2, out
        assert out["lr"] == pytest.approx(0.01 / 3, rel=1e-12), out


def dtensor_param_case() -> str:
    from torch.distributed.tensor import Shard, distribute_tensor

    model = nn.Linear(4, 4)
    mesh = shardtensor.ShardedParam.from_full(torch.zeros(2, 2)).to_dtensor().device_mesh
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    try:
        shardtensor.shard_module(model)
    except NotImplementedError as exc:
        return str(exc) + f" | sharded={any(isinstance(p, shardtensor.ShardedParam) for p in model.parameters())}"
    return "no error"


def test_dtensor_parameter_is_refused_clearly():
    message = run_on_ranks(2, dtensor_param_case)[0]
    assert "'weight' is already a DTensor" in message and "sharded=False" in message, message
    assert "parallelize_module" in message, message  # a DTensor the user made: the tensor-parallel fix


def fully_shard_blocks_case() -> str:
    """FSDP2's habit: ``fully_shard`` on each block, then ``shard_module`` on the root."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for block in model:
        fully_shard(block)
    try:
        shardtensor.shard_module(model)
    except NotImplementedError as exc:
        return str(exc)
    return "no error"


def test_fully_shard_per_block_then_shard_module_names_that_habit():
    # The message spoke of tensor parallelism (parallelize_module, 2-d layouts) to a user who only ran fully_shard.
    for message in run_on_ranks(2, fully_shard_blocks_case):
        assert "fully_shard (FSDP2) already shards '0'" in message and "drop fully_shard" in message, message


class _GainedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.gain = nn.Linear(4, 6), nn.Parameter(torch.ones(1))  # a one-row parameter

    def forward(self, x):
        return self.lin(x) * self.gain


def fully_shard_over_sharded_case(mode: str) -> str:
    """The other order: ``fully_shard`` on a model ``shard_module`` already sharded."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = shardtensor.shard_module(_GainedLinear(), gather=mode)
    try:
        fully_shard(model)
        model(torch.randn(2, 4)).sum().backward()
    except shardtensor.DivergenceError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("mode", ["sequential", "overlapped"])
def test_fully_shard_over_a_sharded_model_names_fsdp2_on_every_rank(mode):
    """Helper E: a DivergenceError of gathers with advice about ``if rank == 0:`` code and MoE routing, while one
    rank was still inside fully_shard."""
    for message in run_on_ranks(2, fully_shard_over_sharded_case, mode):
        assert "In FSDP2's fully_shard()" in message and "unshard_module" in message, message


# ------------------------------------------------------------------------------ damaged checkpoints: all or nothing
def _snapshot(model, opt) -> dict:
    return {"model": shardtensor.full_state_dict(model), "optim": _full_optimizer_state(model, opt),
            "lr": [g["lr"] for g in opt.param_groups]}


def _bit_equal(a: dict, b: dict) -> bool:
    if a["lr"] != b["lr"] or a["model"].keys() != b["model"].keys() or a["optim"].keys() != b["optim"].keys():
        return False
    same = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    return same and all(a["optim"][n].keys() == b["optim"][n].keys() and
                        all(torch.equal(a["optim"][n][k], b["optim"][n][k]) for k in a["optim"][n]) for n in a["optim"])


def damaged_load_case(path: str, seed: int, fresh: bool = False, then: str = "") -> dict:
    """Load into a trained model and optimizer (other values; ``fresh``: an optimizer that never stepped, as on
    resume): either everything equals the saved state, or a named Exception and nothing changed.  ``then``: a
    good checkpoint loaded after the failed load."""
    model = shardtensor.shard_module(_model(seed + 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    if not fresh:
        _train(model, opt, 1, seed + 5)
    before = _snapshot(model, opt)
    try:
        shardtensor.load_checkpoint(path, model, opt)
        error = None
    except BaseException as exc:  # noqa: BLE001 - the test checks it is an Exception
        error = (type(exc).__name__, isinstance(exc, Exception), str(exc))
    after = _snapshot(model, opt)
    if then:  # every rank must still be in step, and the optimizer as it was
        shardtensor.load_checkpoint(then, model, opt)
        _train(model, opt, 1, seed + 6)
    return {"error": error, "unchanged": _bit_equal(before, after), "state": after}


def _saved_reference(path: str, seed: int) -> dict:
    saved = run_on_ranks(2, save_case, path, seed)[0]
    return {"model": saved["model"], "optim": saved["optim"], "lr": [1e-2]}


def _flip(path, position: int, mask: int = 0x40) -> None:
    data = bytearray(path.read_bytes())
    data[position % len(data)] ^= mask
    path.write_bytes(bytes(data))


def _check_damaged_load(path: str, reference: dict, fresh: bool = False, then: str = "") -> list:
    results = run_on_ranks(2, damaged_load_case, path, 3, fresh, then)
    for r in results:
        if r["error"] is None:
            assert _bit_equal(r["state"], reference)
        else:
            name, is_exception, message = r["error"]
            assert is_exception and name == "CheckpointError" and r["unchanged"], r["error"]
            assert "nothing was loaded" in message, message
    return [r["error"] for r in results]


def test_damaged_dcp_checkpoint_is_named_on_every_rank_and_changes_nothing(tmp_path):
    import shutil

    clean = tmp_path / "clean"
    reference = _saved_reference(str(clean), 3)
    damages = {  # damage -> text the message must contain
        "flip a weight byte": ("__0_0.distcp", lambda p: _flip(p, p.stat().st_size // 3), "__0_0.distcp: corrupted"),
        "truncate": ("__1_0.distcp", lambda p: p.write_bytes(p.read_bytes()[:-7]), "__1_0.distcp: truncated"),
        "delete": ("__1_0.distcp", lambda p: p.unlink(), "__1_0.distcp: checkpoint file missing"),
        "damage metadata": (".metadata", lambda p: _flip(p, 40), ".metadata: damaged DCP metadata"),
        "damage checksums": ("shardtensor.checksums.json", lambda p: _flip(p, 30, 0x01), "damaged checksum file"),
    }
    for kind, (name, damage, expected) in damages.items():
        path = tmp_path / kind.replace(" ", "_")
        shutil.copytree(clean, path)
        damage(path / name)
        errors = _check_damaged_load(str(path), reference)
        assert all(e is not None and expected in e[2] for e in errors), (kind, errors)
    # A flipped byte inside a tensor is named by its key (the item whose bytes changed).
    path = tmp_path / "named"
    shutil.copytree(clean, path)
    sidecar = json.loads((path / "shardtensor.checksums.json").read_text())
    key, offset, length, _ = sidecar["files"]["__0_0.distcp"]["items"][0]
    _flip(path / "__0_0.distcp", offset + length // 2)
    errors = _check_damaged_load(str(path), reference)
    assert all(f"the bytes of {key!r} changed" in e[2] for e in errors), errors
    assert _check_damaged_load(str(clean), reference) == [None, None]  # the undamaged copy loads
    # On resume the optimizer has no state yet, and loading makes it (a step at lr 0): each rank checks only its
    # share of the files, so that must wait until every rank's verdict is in (it ran on the ranks whose share
    # was sound, and the step counts then differed: a DivergenceError, that load and every later one).
    errors = _check_damaged_load(str(path), reference, fresh=True, then=str(clean))
    assert all(f"the bytes of {key!r} changed" in e[2] for e in errors), errors


_DCP_FILES = ["__0_0.distcp", "__1_0.distcp", ".metadata", "shardtensor.checksums.json"]


@settings(max_examples=8)
@given(st.lists(st.tuples(st.sampled_from(_DCP_FILES), st.sampled_from(["flip", "truncate"]),
                          st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=3))
def test_random_damage_to_a_dcp_checkpoint_loads_exactly_or_changes_nothing(tmp_path_factory, damages):
    import shutil

    base = tmp_path_factory.getbasetemp() / "dcp_property"
    if not (base / "clean" / "shardtensor.checksums.json").exists():
        _REFERENCE["state"] = _saved_reference(str(base / "clean"), 3)
    path = Path(tempfile.mkdtemp(dir=base))
    shutil.copytree(base / "clean", path, dirs_exist_ok=True)
    for name, how, where, mask in damages:
        target = path / name
        size = target.stat().st_size
        if how == "flip" and size:
            _flip(target, int(where * size), mask)
        elif how == "truncate":
            target.write_bytes(target.read_bytes()[: int(where * size)])
    _check_damaged_load(str(path), _REFERENCE["state"])


_REFERENCE: dict = {}


def shards_case(path: str, mode: str) -> str:
    from shardtensor.checkpoint_files import CheckpointError, load_shards, save_shards

    model = shardtensor.shard_module(_model(0))
    if mode == "save":
        save_shards(model, path)
        return ""
    try:
        load_shards(model, path)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_save_shards_manifest_with_a_flipped_byte_says_it_is_damaged(tmp_path):
    run_on_ranks(2, shards_case, str(tmp_path), "save")
    manifest = tmp_path / "manifest-rank00000-of-00002.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"0.weight"', '"0.weighT"', 1))  # still valid JSON: a renamed key
    for message in run_on_ranks(2, shards_case, str(tmp_path), "load"):
        assert "manifest-rank00000-of-00002.json: damaged manifest" in message, message


def save_on_rank_0_only(path: str) -> dict:
    """`if rank == 0: save_checkpoint(dir, model)` while rank 1 went on to the script's end: DCP's collectives are
    neither checked nor timed, so rank 0 waited for the process group's timeout (30 min).  Now its first step is
    a checked barrier, named at shardtensor's collective timeout."""
    import time

    import torch.distributed as dist

    group = dist.new_group([0, 1])
    model = shardtensor.shard_module(_model(0), group=group)
    previous = shardtensor.set_collective_timeout(3)
    out = {"error": None, "message": "", "seconds": 0.0}
    try:
        if dist.get_rank() == 0:
            started = time.perf_counter()
            try:
                shardtensor.save_checkpoint(path, model)
            except Exception as exc:  # noqa: BLE001 - the test asserts on the type
                out = {"error": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - started}
        dist.barrier(group=group)  # the script's end (rank 0 joins it after its error, releasing rank 1)
    finally:
        shardtensor.set_collective_timeout(previous)
    dist.destroy_process_group(group)
    return out


def test_save_checkpoint_on_rank_0_only_is_named_at_the_collective_timeout(tmp_path):
    rank0, rank1 = run_on_ranks(2, save_on_rank_0_only, str(tmp_path / "ckpt"), timeout=120)
    assert rank0["error"] == "CollectiveError", rank0
    assert "save_checkpoint: every rank of the group must call it" in rank0["message"], rank0["message"]
    assert rank0["seconds"] < 30, rank0
    assert rank1["error"] is None


def paths_per_rank(root: str) -> dict:
    """A checkpoint directory named from the clock (or the rank) is another directory on each rank."""
    import os

    import torch.distributed as dist

    model = shardtensor.shard_module(_model(0))
    path = os.path.join(root, f"ckpt-{dist.get_rank()}")
    out = {}
    for what, call in (("save", lambda: shardtensor.save_checkpoint(path, model)),
                       ("load", lambda: shardtensor.load_checkpoint(path, model))):
        try:
            call()
            out[what] = "no error"
        except ValueError as exc:
            out[what] = str(exc)
    out["written"] = sorted(os.listdir(root))
    return out


def one_directory_spelled_two_ways(root: str) -> bool:
    import os

    import torch.distributed as dist

    model = shardtensor.shard_module(_model(0))
    before = os.getcwd()
    os.chdir(root)
    try:  # "./ckpt/" on rank 0, the absolute path on rank 1: one directory
        path = "./ckpt/" if dist.get_rank() == 0 else os.path.join(root, "ckpt")
        shardtensor.save_checkpoint(path, model)
        shardtensor.load_checkpoint(path, model)
    finally:
        os.chdir(before)  # the rank pool's process serves later tests
    return os.path.exists(os.path.join(root, "ckpt", ".metadata"))


def test_one_checkpoint_directory_spelled_two_ways_is_one_path(tmp_path):
    assert run_on_ranks(2, one_directory_spelled_two_ways, str(tmp_path), timeout=120) == [True, True]


def test_checkpoint_paths_that_differ_between_ranks_are_named_before_anything_is_written(tmp_path):
    for out in run_on_ranks(2, paths_per_rank, str(tmp_path), timeout=120):
        for what in ("save", "load"):
            assert f"{what}_checkpoint: the ranks passed different paths" in out[what], out
            assert "ckpt-0" in out[what] and "ckpt-1" in out[what], out
        assert out["written"] == [], out


def optimizer_on_some_ranks(root: str, what: str) -> dict:
    """``save_checkpoint`` / ``load_checkpoint`` with the optimizer on rank 0 only, or another ``strict``."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank()
    path = os.path.join(root, "ckpt")
    model = shardtensor.shard_module(_model(0))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    shardtensor.save_checkpoint(path, model, opt)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    before = [t.clone() for state in opt.state.values() for t in state.values()]
    params = [p.to_local().clone() for p in model.parameters()]
    calls = {
        "save": lambda: shardtensor.save_checkpoint(os.path.join(root, "other"), model, opt if rank == 0 else None),
        "load": lambda: shardtensor.load_checkpoint(path, model, opt if rank == 0 else None),
        "load, strict on one rank": lambda: shardtensor.load_checkpoint(path, model, opt, strict=rank == 0),
    }
    try:
        calls[what]()
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    after = [t for state in opt.state.values() for t in state.values()]
    unchanged = all(torch.equal(a, b) for a, b in zip(after, before)) and all(
        torch.equal(p.to_local(), q) for p, q in zip(model.parameters(), params))
    return {"message": message, "unchanged": unchanged, "other": os.path.exists(os.path.join(root, "other"))}


@pytest.mark.parametrize("what", ["save", "load", "load, strict on one rank"])
def test_an_optimizer_passed_on_some_ranks_only_is_named_before_anything_is_written(tmp_path, what):
    """``load_checkpoint(path, model, opt if rank == 0 else None)`` restored rank 0's rows of the optimizer state
    alone and left the other ranks' fresh: training went on from neither the checkpoint nor a restart, silently
    (helper 18).  Every rank now raises, naming each rank's call, before anything is read or written."""
    for out in run_on_ranks(2, optimizer_on_some_ranks, str(tmp_path), what, timeout=120):
        assert "the ranks called it with different arguments" in out["message"], out
        assert "rank 0: optimizer=Adam" in out["message"] and "rank 1: optimizer=" in out["message"], out
        assert out["unchanged"] and not out["other"], out


def _groups(model, split: str) -> list:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if split == "weights, biases":
        return [{"params": weights}, {"params": biases, "lr": 5e-3}]
    first = list(model[0].parameters())
    return [{"params": first}, {"params": [p for p in model.parameters() if all(p is not q for q in first)]}]


def regrouped_case(path: str) -> tuple:
    model = shardtensor.shard_module(_model(0))
    opt = torch.optim.Adam(_groups(model, "weights, biases"), lr=1e-2)
    _train(model, opt, 1, 0)
    shardtensor.save_checkpoint(path, model, opt)
    fresh = shardtensor.shard_module(_model(1))
    regrouped = torch.optim.Adam(_groups(fresh, "first layer, rest"), lr=0.5)
    _train(fresh, regrouped, 1, 1)
    before = _snapshot(fresh, regrouped)
    try:
        shardtensor.load_checkpoint(path, fresh, regrouped)
        error = "no error"
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    return error, _bit_equal(before, _snapshot(fresh, regrouped))


def test_param_groups_that_hold_other_parameters_than_when_saved_are_refused(tmp_path):
    # Same number of groups, other members: torch mapped both saved groups onto one, and the other lost its lr.
    for error, unchanged in run_on_ranks(2, regrouped_case, str(tmp_path / "ckpt")):
        assert "CheckpointError" in error and "param group 0 holds parameters of saved groups [0, 1]" in error, error
        assert unchanged


def unshared_directory_case(path: str) -> str:
    import torch.distributed as dist

    from shardtensor import checkpoint

    model = shardtensor.shard_module(_model(0))
    original = checkpoint.read_metadata_unverified
    if dist.get_rank() == 1:  # as if rank 1's directory were another machine's: the metadata is not there
        def missing(directory):
            raise shardtensor.checkpoint_files.CheckpointError(f"{directory}/.metadata: missing")
        checkpoint.read_metadata_unverified = missing
    try:
        shardtensor.save_checkpoint(path, model)
        return "no error"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        checkpoint.read_metadata_unverified = original  # the rank pool's process runs other tests next


def test_a_checkpoint_directory_some_rank_cannot_read_back_is_named_on_every_rank(tmp_path):
    for message in run_on_ranks(2, unshared_directory_case, str(tmp_path / "ckpt")):
        assert "CheckpointError" in message and "rank 1 cannot read the checkpoint" in message, message
        assert "shares" in message


class _WithSpareHead(nn.Module):
    """A trunk, and a head the first phase of training never uses (an auxiliary head, an expert no token
    reached): it has no optimizer state when the checkpoint is saved."""

    def __init__(self, seed: int, new_head: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk, self.spare = nn.Sequential(nn.Linear(6, 7), nn.Tanh()), nn.Linear(7, 3)
        if new_head:  # added for fine-tuning after the save
            self.new = nn.Linear(7, 2)

    def forward(self, x, heads):
        h = self.trunk(x)
        return sum(getattr(self, name)(h).square().mean() for name in heads)


def never_saved_case(path: str, mode: str) -> dict:
    """mode "reference": 2 steps on the trunk, 1 step using the spare head too.  "save": the 2 steps, saved.
    "load": fresh processes, a fresh model (other values) and optimizer, the load, then the third step;
    "load-new-head": the same into a model with one more head, ``strict=False``."""
    model = shardtensor.shard_module(_WithSpareHead(0 if mode in ("reference", "save") else 1,
                                                    new_head=mode == "load-new-head"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    new_head_before = {k: v.clone() for k, v in shardtensor.full_state_dict(model).items() if k.startswith("new.")}
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 6, generator=gen) for _ in range(3)]
    if mode.startswith("load"):
        shardtensor.load_checkpoint(path, model, opt, strict=mode == "load")
    else:
        for x in batches[:2]:
            model.trunk(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if mode == "save":
            shardtensor.save_checkpoint(path, model, opt)
    stateless = sorted(n for n, p in model.named_parameters() if p not in opt.state)
    model.trunk(batches[2]).square().mean().add(model(batches[2], ["spare"])).backward()
    opt.step()
    full = shardtensor.full_state_dict(model)
    return {"stateless": stateless, "after": {k: v for k, v in full.items() if not k.startswith("new.")},
            "new_head_kept": all(torch.equal(full[k], v) for k, v in new_head_before.items()) and
            (mode != "load-new-head" or len(new_head_before) == 2)}


def test_a_parameter_without_saved_optimizer_state_starts_fresh_and_strict_false_keeps_new_tensors(tmp_path):
    # load_checkpoint gave a fresh optimizer zero state for every parameter, then required all of it in the
    # checkpoint: a resume with an unused head was refused ("... is not in the checkpoint; was it saved from
    # another model?"), and strict=False refused a model with a head added after the save.
    path = str(tmp_path / "ckpt")
    reference = run_on_ranks(2, never_saved_case, path, "reference")
    run_on_ranks(2, never_saved_case, path, "save")
    for mode in ("load", "load-new-head"):
        for rank, got in enumerate(run_on_ranks(2, never_saved_case, path, mode)):
            want = reference[rank]
            extra = ["new.bias", "new.weight"] if mode == "load-new-head" else []
            assert got["stateless"] == sorted(want["stateless"] + extra), (mode, rank, got["stateless"])
            assert got["new_head_kept"], (mode, rank)
            for key, value in want["after"].items():  # the third step as in the run that never stopped
                assert torch.equal(got["after"][key], value), (mode, rank, key)


def other_kind_case(path: str, mode: str) -> str:
    """Saved: ``_WithSpareHead`` and Adam.  Loaded: the same model inside a wrapper (every key prefixed), with
    ``strict=False``; or the same model with SGD (momentum) instead of Adam."""
    from shardtensor.checkpoint_files import CheckpointError

    model = _WithSpareHead(0)
    if mode == "save":
        shardtensor.shard_module(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model.trunk(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        shardtensor.save_checkpoint(path, model, opt)
        return "saved"
    target = nn.Sequential(model) if mode == "wrapped" else model
    shardtensor.shard_module(target)
    opt = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9) if mode == "sgd" else \
        torch.optim.Adam(target.parameters(), lr=1e-2)
    try:
        shardtensor.load_checkpoint(path, target, opt, strict=mode != "wrapped")
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_checkpoints_of_another_model_or_optimizer_kind_are_still_named(tmp_path):
    # After the two allowances above, strict=False of a wrapper's checkpoint loaded nothing without a word, and
    # an Adam checkpoint into SGD failed inside DCP ("CheckpointException ranks: dict_keys([0, 1])").
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, other_kind_case, path, "save")
    for message in run_on_ranks(2, other_kind_case, path, "wrapped"):
        assert "none of the model's tensors is in the checkpoint" in message, message
    for message in run_on_ranks(2, other_kind_case, path, "sgd"):
        assert "saved with another kind of optimizer" in message and "'momentum', 'nesterov'" in message, message



def batch_norm_buffers_case(path: str) -> dict:
    """Each rank's BatchNorm statistics differ (its own batches, not synchronised, as under FSDP2); a save and a
    load into a fresh model."""
    import torch.distributed as dist

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2), nn.BatchNorm1d(2))

    model = shardtensor.shard_module(build())
    rank = dist.get_rank()
    for step in range(2):
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + rank))
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, buffers)
    shardtensor.save_checkpoint(path, model)
    fresh = shardtensor.shard_module(build())
    shardtensor.load_checkpoint(path, fresh)
    loaded = fresh.state_dict()
    return {"rank 0's": all(torch.equal(loaded[k], v) for k, v in everyone[0].items()),
            "ranks differed": any(not torch.equal(everyone[1][k], v) for k, v in everyone[0].items())}


@pytest.mark.parametrize("world", [2, 4])
def test_buffers_saved_are_rank_0s_on_every_rank(tmp_path, world):
    """Helper D: DCP wrote each replicated tensor from a rank of its choosing, so a resumed model had rank 1's
    running_mean beside rank 2's running_var, matching no rank (evaluation after resuming moved by 0.04)."""
    for out in run_on_ranks(world, batch_norm_buffers_case, str(tmp_path / "ckpt")):
        assert out == {"rank 0's": True, "ranks differed": True}, out
