"""``save_checkpoint`` / ``load_checkpoint`` with optimizers whose state is per-rank plain tensors of the local
shard's shape (``CPUAdam``, ``NVMeCPUAdam``): each rank's moments must come back to the rank (or, resharded, the
rows) they belong to, so that training resumes bit-identically.  DCP takes a plain tensor for a replicated one
and keeps one rank's copy; unless the checkpoint presents these as shards, every rank gets rank 0's moments.
Companion optimizers that cannot round-trip (``Muon``: per-rank owned state) must refuse at save time."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import shardtensor
from rank_pool import run_on_ranks
from shardtensor.checkpoint_files import CheckpointError
from shardtensor.optim.cpu_adam import CPUAdam


def _model(seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)  # 7 and 5 rows: the last rank's shards are padded at world 2
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5)).to(dtype)


def _train(model, opt, steps: int, seed: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=gen).to(dtype)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _optimizer(kind: str, model: nn.Module, tmpdir: str):
    if kind == "nvme":
        from shardtensor.offload import NVMeCPUAdam, NVMeOffload

        rank = torch.distributed.get_rank()
        offload = NVMeOffload(os.path.join(tmpdir, f"swap{rank}_{os.getpid()}"), budget_bytes=1 << 20,
                              buffer_bytes=4096, workers=1)
        return NVMeCPUAdam(model.parameters(), offload, lr=1e-2, speculative=False)
    return CPUAdam(model.parameters(), lr=1e-2, speculative=False)


def _local_state(model, opt) -> dict:
    """This rank's shards (padding included) of every parameter and of its CPUAdam state, and the valid rows."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state_dict()["state"][opt_index(opt, p)]
        out[name] = {"valid": p.shard_layout.valid_rows, "param": p.to_local().clone(),
                     **{k: (v.to_local() if isinstance(v, shardtensor.ShardedParam) else v).clone()
                        for k, v in state.items()}}
    return out


def opt_index(opt, p) -> int:
    return [id(q) for g in opt.param_groups for q in g["params"]].index(id(p))


def cpu_adam_case(path: str, mode: str, kind: str, dtype: torch.dtype) -> dict:
    """mode "reference": 3 steps.  "save": 2 steps, then save.  "load": a fresh model and optimizer (another seed,
    another lr), load, 1 step.  Returns this rank's state after loading (or after 2 steps) and after step 3."""
    model = shardtensor.shard_module(_model(0 if mode != "load" else 1, dtype))
    opt = _optimizer(kind, model, path + "-swap")
    if mode == "load":
        opt.param_groups[0]["lr"] = 0.5
        shardtensor.load_checkpoint(path, model, opt)
    else:
        _train(model, opt, 2, 0, dtype)
        if mode == "save":
            shardtensor.save_checkpoint(path, model, opt)
    before = _local_state(model, opt)
    _train(model, opt, 1, 1, dtype)
    return {"before": before, "after": _local_state(model, opt), "lr": opt.param_groups[0]["lr"]}


def _full(ranks: list[dict], when: str) -> dict:
    """The unpadded full tensors, from every rank's valid rows (step counts from rank 0)."""
    out = {}
    for name, first in ranks[0][when].items():
        out[name] = {k: (torch.cat([r[when][name][k][: r[when][name]["valid"]] for r in ranks]) if v.dim() else v)
                     for k, v in first.items() if k != "valid"}
    return out


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, values in want.items():
        assert got[name].keys() == values.keys(), (what, name)
        for k, v in values.items():
            if k == "valid":
                continue
            assert got[name][k].dtype == v.dtype and torch.equal(got[name][k], v), f"{what}: {name}.{k} differs"


@pytest.mark.parametrize("kind,dtype", [("cpu_adam", torch.float32), ("cpu_adam", torch.bfloat16),
                                        ("nvme", torch.float32)])
def test_cpu_adam_checkpoint_resumes_bit_identically(tmp_path, kind, dtype):
    """world 2 -> 2: every rank's parameters and moments (and the fp32 master of bf16 parameters) are its own
    again after the load, and one more step matches the run that never saved, on every rank."""
    path = str(tmp_path / "ckpt")
    reference = run_on_ranks(2, cpu_adam_case, path, "reference", kind, dtype)
    saved = run_on_ranks(2, cpu_adam_case, path, "save", kind, dtype)
    loaded = run_on_ranks(2, cpu_adam_case, path, "load", kind, dtype)
    assert any(not torch.equal(saved[0]["before"][n]["exp_avg"][: saved[1]["before"][n]["valid"]],
                               saved[1]["before"][n]["exp_avg"][: saved[1]["before"][n]["valid"]])
               for n in saved[0]["before"]), "the ranks' moments must differ, or the test shows nothing"
    for rank in range(2):
        assert loaded[rank]["lr"] == 1e-2
        _assert_equal(loaded[rank]["before"], saved[rank]["before"], f"rank {rank} after load")
        _assert_equal(loaded[rank]["after"], reference[rank]["after"], f"rank {rank} after the next step")


def test_cpu_adam_checkpoint_reshards_2_to_1(tmp_path):
    """world 2 -> 1: the one rank gets every rank's rows of the moments (and the parameters), bit-exactly.  (Not
    the step after: worlds 1 and 2 differ by ulps in their gradients' reduction, checkpoint or not.)"""
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, cpu_adam_case, path, "save", "cpu_adam", torch.float32)
    (loaded,) = run_on_ranks(1, cpu_adam_case, path, "load", "cpu_adam", torch.float32)
    assert loaded["lr"] == 1e-2
    _assert_equal(_full([loaded], "before"), _full(saved, "before"), "world 1 after load")


class _PerRankState(torch.optim.Optimizer):
    """State that depends on the shard but is not shaped like it: per-row statistics ("rows"), or a per-rank
    scalar ("scalar").  Neither can be saved as the parameter's shards nor as a replicated tensor."""

    def __init__(self, params, which: str):
        self.which = which
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                local = p.to_local()
                rows = local.reshape(local.shape[0], -1).square().sum(1)
                self.state[p]["stat"] = rows if self.which == "rows" else rows.sum()


def refusal_case(path: str, which: str) -> str:
    placement = "layerwise" if which == "muon" else "dim0"
    model = shardtensor.shard_module(_model(0, torch.float32), placement=placement)
    if which == "muon":
        from shardtensor.optim import Muon

        opt = Muon(model)
    else:
        opt = _PerRankState(model.parameters(), which)
    _train(model, opt, 1, 0, torch.float32)
    try:
        shardtensor.save_checkpoint(path, model, opt)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


@pytest.mark.parametrize("which,name", [("muon", "Muon"), ("rows", "_PerRankState"), ("scalar", "_PerRankState")])
def test_per_rank_optimizer_state_that_cannot_round_trip_is_refused_at_save(tmp_path, which, name):
    """Muon (each rank's own inner optimizers), shard-dependent state of another shape, and a plain tensor that
    differs between ranks: save_checkpoint raises on every rank, naming the optimizer and a fix, and writes
    nothing (DCP would keep one rank's copy and load it into all)."""
    path = str(tmp_path / "ckpt")
    for message in run_on_ranks(2, refusal_case, path, which):
        assert name in message and "Fix" in message, message
    assert not os.path.exists(os.path.join(path, ".metadata"))


def public_state_dict_case() -> dict:
    """What ``sharded_optimizer_state_dict`` hands to DCP for CPUAdam's per-rank moments."""
    from torch.distributed.tensor import DTensor

    model = shardtensor.shard_module(_model(0, torch.float32))
    opt = CPUAdam(model.parameters(), lr=1e-2, speculative=False)
    _train(model, opt, 1, 0, torch.float32)
    state = shardtensor.sharded_optimizer_state_dict(model, opt)["state"]
    params = dict(model.named_parameters())
    return {f"{fqn}.{key}": (isinstance(v, DTensor), tuple(v.shape) == tuple(params[fqn].shape))
            for fqn, values in state.items() for key, v in values.items() if key != "step"}


def test_the_public_optimizer_state_dict_gives_cpu_adam_moments_as_shards():
    # a plain per-rank tensor would reach DCP as replicated: one rank's moments saved for everyone
    for rank_out in run_on_ranks(2, public_state_dict_case):
        assert rank_out and all(is_d and full for is_d, full in rank_out.values()), rank_out


def users_own_dcp_case(path: str, mode: str) -> dict:
    """torch's ``get_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_state_dict`` (the README's own-DCP path),
    and per-rank ``torch.save(opt.state_dict())`` files, with CPUAdam."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = torch.distributed.get_rank()
    model = shardtensor.shard_module(_model(0 if mode == "save" else 1, torch.float32))
    opt = CPUAdam(model.parameters(), lr=1e-2, speculative=False)
    if mode == "save":
        _train(model, opt, 2, 0, torch.float32)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        torch.save(opt.state_dict(), f"{path}-rank{rank}.pt")
        return {"state": _local_state(model, opt)}
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out = {"state": _local_state(model, opt)}
    try:
        opt.load_state_dict(torch.load(f"{path}-rank0.pt", weights_only=True))  # rank 0's file, on every rank
        out["rank0_file"] = "no error"
    except RuntimeError as exc:
        out["rank0_file"] = str(exc)
    out["after_refusal"] = _local_state(model, opt)
    opt.load_state_dict(torch.load(f"{path}-rank{rank}.pt", weights_only=True))
    out["own_file"] = _local_state(model, opt)
    return out


def test_cpu_adam_state_through_torchs_own_dcp_helpers_and_per_rank_files_keeps_each_ranks_rows(tmp_path):
    # CPUAdam's moments are plain per-rank tensors: torch's helpers handed them to DCP as replicated, which saved
    # rank 0's and loaded them into every rank (rank 1 then stepped with rank 0's moments, silently), and rank
    # 0's per-rank file loaded on rank 1.  Its state_dict() now gives them as shards of their parameters.
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, users_own_dcp_case, path, "save")
    loaded = run_on_ranks(2, users_own_dcp_case, path, "load")
    assert any(not torch.equal(saved[0]["state"][n]["exp_avg"], saved[1]["state"][n]["exp_avg"])
               for n in saved[0]["state"]), "the ranks' moments must differ, or the test shows nothing"
    for rank in range(2):
        _assert_equal(loaded[rank]["state"], saved[rank]["state"], f"rank {rank} after dcp.load")
        _assert_equal(loaded[rank]["after_refusal"], saved[rank]["state"], f"rank {rank} after a refused load")
        _assert_equal(loaded[rank]["own_file"], saved[rank]["state"], f"rank {rank} after its own file")
        want = "holds rank 0's rows" if rank == 1 else "another rank's state is not its own rows"
        assert want in loaded[rank]["rank0_file"] and "Nothing was loaded" in loaded[rank]["rank0_file"], \
            (rank, loaded[rank]["rank0_file"])

