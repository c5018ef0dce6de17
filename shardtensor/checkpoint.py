"""Distributed checkpoints: each rank writes its rows, any world size reads them back (resharding).

    shardtensor.save_checkpoint(path, model, opt)        # torch.distributed.checkpoint, one file per rank
    shardtensor.load_checkpoint(path, model, opt)        # world size may differ from the one that saved

[Note: state dicts are torch's]
The state dicts are the ones ``torch.distributed.checkpoint.state_dict`` makes and consumes
(``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``set_model_state_dict`` /
``set_optimizer_state_dict``): optimizer state keyed by parameter name (it survives a model that registers its
parameters in another order), hyper-parameters restored by ``optimizer.load_state_dict``.  Their values are the
module's and optimizer's own ShardedParams, and a ShardedParam speaks DCP's protocol for partial tensors as the
``Shard(0)`` DTensor ``to_dtensor()`` gives over this rank's valid rows (a view, no copy).  So DCP saves exactly
the unpadded rows and, on load, copies the overlapping rows of whatever ranks saved into the shards in place:
resharding W -> W' is DCP's, and bit-exact (rows are copied, never recomputed).  Replicated scalars (Adam's
``step``) are saved once; per-rank state shaped like the local shard (CPUAdam's moments) is saved as shards too
(see [Note: per-rank optimizer state]).  A user's own ``get_state_dict`` + ``dcp.save`` / ``dcp.load`` +
``set_state_dict`` works the same way, with CPUAdam too: its ``state_dict()`` gives its moments as shards of
their parameters (``optim/_state_shards.py``).

Loads are all-or-nothing: see [Note: all-or-nothing loads] in ``checkpoint_verify.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils._pytree import tree_map_only

from . import _comm
from .checkpoint_files import CheckpointError
from .checkpoint_match import (
    _MODEL,
    _OPTIM,
    check_against_metadata,
    check_param_groups,
    hold_back_unsaved_settings,
    leave_out_what_was_never_saved,
    put_back_settings,
)
from ._misuse_optim import making_state
from ._state_to_load_into import made_to_load_into
from .checkpoint_verify import file_records, read_metadata_unverified, verify, write_sidecar
from .tensor import ShardedParam



# ---------------------------------------------------------------------------------------------- state dicts
def sharded_state_dict(module: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(module)`` with every ShardedParam as a ``Shard(0)`` DTensor over this rank's rows
    (no copy).

    Pass it to ``torch.distributed.checkpoint.save``; ``torch.distributed.checkpoint.load`` into it writes the
    loaded rows into the module's shards in place.
    """
    return _as_dtensors(get_model_state_dict(module))


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(module, optimizer)``, ShardedParam states as DTensors (no copy).

    ``{"state": {name: {"exp_avg": DTensor, "step": tensor, ...}}, "param_groups": [{..., "params": [names]}]}``
    An optimizer that has not stepped yet gets state for ``dcp.load`` to fill, as torch's helper makes it; if no
    load fills it by the next step it is dropped (see [Note: state made to load into]).  Per-rank state of the
    local shard's shape (CPUAdam's moments) comes as DTensors too (see [Note: per-rank optimizer state]).
    """
    fresh = not optimizer.state
    state = _optimizer_state_dict(module, optimizer, to_load_into=fresh)
    if fresh and optimizer.state:
        made_to_load_into(optimizer)
    return _as_dtensors(_present_shards(optimizer, state)[0] if state["state"] else state)


def _as_dtensors(state: dict) -> dict:
    return tree_map_only(ShardedParam, lambda t: t.to_dtensor(), state)


# [Note: per-rank optimizer state]
# Optimizers that step ``p.to_local()`` (CPUAdam, NVMeCPUAdam) keep their state (exp_avg, exp_avg_sq, an fp32
# master) as plain tensors of the local shard's shape, one per rank.  DCP takes a plain tensor for a replicated
# one: it would save one rank's copy and load it into every rank (silently wrong moments), or fail on shape at
# another world size.  So such a value is presented to DCP as a ShardedParam over its parameter's layout (a
# wrapper, no copy): it is saved and resharded exactly like the parameter, and loaded in place into the plain
# tensor, which the optimizer gets back unwrapped (its padding rows zeroed, as a fresh shard's are).  Any other
# plain tensor in the state must be the same on every rank (a 0-d ``step``, a full-shape copy): save checks
# that with one exchange of hashes, and a plain tensor of any other shape beside a sharded parameter is refused,
# naming the optimizer: DCP could not tell whose rows it holds.
def _present_shards(optimizer: torch.optim.Optimizer, state: dict) -> tuple[dict, list]:
    """``state`` with the plain shard-shaped tensors of ShardedParam parameters wrapped as ShardedParams (new
    per-parameter dicts: torch's state dict shares the optimizer's live ones), and the wrappers."""
    wrapped: list[ShardedParam] = []
    for group, names in zip(optimizer.param_groups, (g["params"] for g in state["param_groups"])):
        for param, fqn in zip(group["params"], names):
            values = state["state"].get(fqn)
            if not isinstance(param, ShardedParam) or not values:
                continue
            state["state"][fqn] = values = dict(values)
            for key, value in values.items():
                if type(value) is not torch.Tensor:
                    continue  # a ShardedParam / DTensor of its own, or not a tensor
                if value.shape != param.to_local().shape:  # (first: at world 1 it is also the full shape)
                    if value.dim() == 0 or value.shape == param.shape:
                        continue  # replicated (checked on save)
                    raise CheckpointError(
                        f"checkpoint: {type(optimizer).__name__} state {fqn}.{key} is a plain tensor of shape "
                        f"{tuple(value.shape)} beside the sharded parameter {fqn} {tuple(param.shape)} (local shard "
                        f"{tuple(param.to_local().shape)}): DCP cannot tell whose rows it holds. Fix: keep per-shard "
                        "state in tensors of the local shard's shape (saved as shards) or as ShardedParams, or save "
                        "the optimizer's state_dict() per rank with torch.save and load it at the same world size")
                values[key] = ShardedParam.from_local(value, param.shard_layout, name=f"{fqn}.{key}")
                wrapped.append(values[key])
    return state, wrapped


def _unwrap_shards(state: dict, wrapped: list) -> dict:
    """The plain tensors back in place of the wrappers (after ``dcp.load`` wrote their valid rows)."""
    ids = {id(t) for t in wrapped}
    for t in wrapped:
        t._local[t.shard_layout.valid_rows:].zero_()
    per_param = {fqn: {k: v._local if id(v) in ids else v for k, v in values.items()}
                 for fqn, values in state["state"].items()}
    return {**state, "state": per_param}


def _replicated_fingerprints(state: dict) -> dict:
    """Hash of every plain tensor of the optimizer state that DCP saves once, taking it for replicated."""
    import hashlib

    out = {}
    for fqn, values in state["state"].items():
        for key, value in values.items():
            if type(value) is torch.Tensor:
                data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                out[f"{fqn}.{key}"] = (tuple(value.shape), str(value.dtype), hashlib.blake2b(data).hexdigest())
    return out


def _check_replicated(optimizer, state: dict, error: str, group) -> None:
    """Raise on every rank when any rank failed, or when a plain state tensor differs between ranks."""
    mine = (error, {} if error else _replicated_fingerprints(state))
    verdicts = _comm.all_gather_object(mine, group, label="save_checkpoint (checking replicated optimizer state)")
    errors = [e for e, _ in verdicts if e]
    if errors:
        raise CheckpointError("save_checkpoint: nothing was saved: " + " | ".join(dict.fromkeys(errors)))
    for key, value in verdicts[0][1].items():
        if any(other.get(key) != value for _, other in verdicts[1:]):
            raise CheckpointError(
                f"save_checkpoint: {type(optimizer).__name__} state {key} is a plain tensor that differs between "
                "ranks; DCP would save one rank's copy and load it into all. Fix: keep per-shard state in "
                "tensors of the parameter's local shard shape (saved as shards) or as ShardedParams")


def _refuse_per_rank_optimizer(optimizer) -> None:
    """Raised on every rank (each holds the same kind of optimizer) before any collective."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):  # optim.Muon: per-rank parts
        raise CheckpointError(
            f"checkpoint: {type(optimizer).__name__} is not a torch.optim.Optimizer over the module's parameters, "
            "so its state cannot be saved as the module's (each rank holds its own part). Nothing was changed. "
            "Fix: save_checkpoint(path, model) for the model, and torch.save(optimizer.state_dict()) per rank "
            "beside it, loaded at the same world size and placement")


def _optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, *, to_load_into: bool) -> dict:
    """``get_optimizer_state_dict``, with two of its habits kept from reaching the caller.

    An optimizer that has not stepped has no state tensors for ``dcp.load`` to load into, so the helper makes
    them with one step at lr 0 on zero gradients; but it skips that when any parameter already has a gradient
    (it takes that for a stateless optimizer such as SGD that has stepped), which would leave a load right after
    a backward nothing to load into.  So the gradients are set aside around the call and put back after.  That
    step also counts (Adam's ``step`` becomes 1, changing its next bias correction), so unless the state is made
    to be loaded into, it is dropped again: saving never changes how training continues.
    """
    _refuse_per_rank_optimizer(optimizer)
    names = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in "
                    f"{type(module).__name__} (build the optimizer on model.parameters())")
    if optimizer.state:
        return get_optimizer_state_dict(module, optimizer)
    grads = [(param, param.grad) for group in optimizer.param_groups for param in group["params"]]
    for param, _ in grads:
        param.grad = None
    try:
        with making_state(optimizer):  # (a step at lr 0, not the user's: see there)
            state = get_optimizer_state_dict(module, optimizer)
    finally:
        for param, grad in grads:
            param.grad = grad
    if not to_load_into:
        optimizer.state.clear()
        state["state"] = {}
    return state


# ---------------------------------------------------------------------------------------------- save / load
def _group(module: nn.Module):
    state = getattr(module, "_shardtensor", None)
    return state.group if state is not None else None


def _dcp(call, what: str, path) -> None:
    """Run a DCP call; its ``CheckpointException`` is a ``BaseException`` (``except Exception`` misses it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        call()
    except (CheckpointException, Exception) as exc:  # noqa: BLE001
        raise CheckpointError(f"{path}: torch.distributed.checkpoint.{what} failed: {_causes(exc)}") from exc


def _causes(exc: BaseException) -> str:
    """Each rank's own error: a ``CheckpointException``'s text is every rank's traceback, whose first lines
    (all a message could show) named DCP's frames, not the key it missed."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(exc).__name__}: {str(exc)[:500]}"
    texts: dict = {}
    for rank, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        texts.setdefault(f"{type(cause).__name__}: {str(cause)[:300]}", []).append(str(rank))
    return " | ".join(f"{text} (rank {', '.join(ranks)})" for text, ranks in texts.items())


def save_checkpoint(path: str | os.PathLike, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Save the module (and optimizer) shards with ``torch.distributed.checkpoint`` into directory ``path``, and
    the checksums of every file and item beside them (``shardtensor.checksums.json``).

    A collective: every rank calls it with the same ``path`` (a shared file system across hosts).
    """
    import torch.distributed.checkpoint as dcp

    _refuse_per_rank_optimizer(optimizer)
    group, directory = _group(module), Path(path)
    _same_call_on_every_rank(path, group, "save_checkpoint", optimizer)
    state = {_MODEL: get_model_state_dict(module)}  # ShardedParams: DCP saves their rows (see the Note above)
    if _comm.rank(group) != 0:  # whole tensors (buffers, kept-whole parameters) are rank 0's, as DDP's buffers:
        state[_MODEL] = {k: v for k, v in state[_MODEL].items()  # DCP wrote each from whichever rank it chose,
                         if isinstance(v, ShardedParam) or not isinstance(v, torch.Tensor)}  # BatchNorm's mixed
    if optimizer is not None:
        error = ""
        try:
            state[_OPTIM], _ = _present_shards(optimizer, _optimizer_state_dict(module, optimizer,
                                                                                      to_load_into=False))
        except Exception as exc:  # noqa: BLE001 - every rank must reach the verdict exchange
            error = str(exc) if isinstance(exc, CheckpointError) else f"{path}: {type(exc).__name__}: {exc}"
        _check_replicated(optimizer, state.get(_OPTIM, {}), error, group)
    _dcp(lambda: dcp.save(state, checkpoint_id=os.fspath(path), process_group=group), "save", path)
    rank, world = _comm.rank(group), _comm.world_size(group)
    try:
        mine = file_records(directory, read_metadata_unverified(directory), rank, world)  # each file hashed once
    except Exception as exc:  # noqa: BLE001 - e.g. a directory that is not shared: every rank must hear of it
        mine = (f"rank {rank} cannot read the checkpoint it just wrote ({type(exc).__name__}: {str(exc)[:300]}); "
                "is the directory on a file system every rank shares?")
    files: dict = {}
    parts = _comm.all_gather_object(mine, group, label="save_checkpoint (collecting checksums)")
    errors = [part for part in parts if isinstance(part, str)]
    if errors:
        raise CheckpointError(f"{path}: save_checkpoint: the checkpoint is incomplete: " + " | ".join(errors))
    for part in parts:
        files.update(part)
    if rank == 0:
        write_sidecar(directory, world, files)
    _comm.barrier(group, label="save_checkpoint (waiting for the checksum file)")


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    *, strict: bool = True, verify_checksums: bool = True) -> None:
    """Load a checkpoint written by ``save_checkpoint`` at any world size into this (sharded) module, in place.

    All or nothing: before anything is copied, every rank checks the checksum file, DCP's metadata, every
    file's size, the sha256 of its share of the files, and the checkpoint's keys, shapes and dtypes against the
    module and optimizer; the verdicts are exchanged in one collective, and any failure raises
    ``CheckpointError`` (a ``ValueError``) on every rank, naming the file or parameter, with the module and
    optimizer unchanged.  ``verify_checksums=False`` loads a checkpoint without a checksum file (written by
    ``torch.distributed.checkpoint.save`` directly); the key, shape and dtype checks still run.
    Optimizer hyper-parameters (lr, betas...) are restored too.
    """
    import torch.distributed.checkpoint as dcp

    _refuse_per_rank_optimizer(optimizer)
    group, directory = _group(module), Path(path)
    _same_call_on_every_rank(path, group, "load_checkpoint", optimizer, strict=strict,
                             verify_checksums=verify_checksums)
    fresh = optimizer is not None and not optimizer.state
    error, metadata, held = "", None, []
    try:  # the files first, agreed by every rank before any rank makes optimizer state (a step, on some ranks)
        metadata = verify(directory, _comm.rank(group), _comm.world_size(group)) if verify_checksums \
            else read_metadata_unverified(directory, files_present=True)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the verdict exchange
        error = str(exc) if isinstance(exc, CheckpointError) else f"{path}: {type(exc).__name__}: {exc}"
    _raise_if_any_failed(error, group, "load_checkpoint (exchanging the files' verdicts)")
    try:
        state = {_MODEL: get_model_state_dict(module)}  # the module's own tensors: dcp.load fills them in place
        if optimizer is not None:
            # A fresh optimizer gets zero state to load into (undone below if the load is refused).
            state[_OPTIM], wrapped = _present_shards(optimizer,
                                                     _optimizer_state_dict(module, optimizer, to_load_into=True))
            check_param_groups(metadata, optimizer, state[_OPTIM], path)
            held = hold_back_unsaved_settings(metadata, state)
        leave_out_what_was_never_saved(metadata, state, strict)
        check_against_metadata(metadata, state, strict)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the verdict exchange
        error = str(exc) if isinstance(exc, CheckpointError) else f"{path}: {type(exc).__name__}: {exc}"
    try:
        _raise_if_any_failed(error, group, "load_checkpoint (exchanging verdicts)")
    except CheckpointError:
        if fresh:
            optimizer.state.clear()  # the zero state made to load into: the optimizer is as it was
        raise
    try:
        _dcp(lambda: dcp.load(state, checkpoint_id=os.fspath(path), process_group=group), "load", path)
    except CheckpointError:
        if fresh:
            optimizer.state.clear()
        raise
    put_back_settings(held)
    # The tensors were loaded in place; these put back what DCP replaced instead (non-tensor values, the optimizer's
    # hyper-parameters).  Not strict for the optimizer: a parameter that never had a gradient has no state, in
    # the checkpoint or here, and that is no reason to fail half way through a load.
    set_model_state_dict(module, state[_MODEL], options=StateDictOptions(strict=strict))
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, _unwrap_shards(state[_OPTIM], wrapped),
                                 options=StateDictOptions(strict=False))


def _raise_if_any_failed(error: str, group, label: str) -> None:
    """Exchange each rank's verdict (its error, or ""); any error raises ``CheckpointError`` on every rank."""
    errors = [e for e in _comm.all_gather_object(error, group, label=label) if e]
    if errors:
        what = label.split(" ", 1)[0]
        reasons = dict.fromkeys(e.removeprefix(f"{what}: ") for e in errors)
        raise CheckpointError(f"{what}: nothing was {'saved' if what == 'save_checkpoint' else 'loaded'}: "
                              + " | ".join(reasons))


def _same_call_on_every_rank(path, group, what: str, optimizer, **flags) -> None:
    """DCP's own collectives are neither checked nor timed: a save under `if rank == 0:` waited in them for the
    process group's timeout (30 min), and ranks given different directories (a path from the clock) wrote or
    read different checkpoints.  This checked exchange names both first; and an optimizer given on some ranks
    only (``opt if rank == 0 else None``), or another ``strict``, which loaded one rank's optimizer state and left
    the others fresh: each rank's rows then stepped from another state, silently."""
    call = (type(optimizer).__name__ if optimizer is not None else None, sorted(flags.items()))
    paths = _comm.all_gather_object((os.fspath(path), os.path.abspath(path), call), group,
                                    label=f"{what}: every rank of the group must call it, not only rank 0")
    if len({absolute for _, absolute, _ in paths}) > 1:  # ("./ckpt/" and "/work/ckpt" in /work are one directory)
        which = ", ".join(f"rank {r}: {given!r}" + (f" (= {absolute!r})" if given != absolute else "")
                          for r, (given, absolute, _) in enumerate(paths))
        raise ValueError(f"{what}: the ranks passed different paths ({which}), but a checkpoint is one directory "
                         "that every rank writes and reads. Nothing was written or read. Fix: derive the path "
                         "from something every rank shares (the step number), not the clock or the rank.")
    if len({repr(c) for _, _, c in paths}) > 1:
        which = ", ".join(f"rank {r}: optimizer={c[0] or 'None'}" + "".join(f", {k}={v}" for k, v in c[1])
                          for r, (_, _, c) in enumerate(paths))
        raise ValueError(f"{what}: the ranks called it with different arguments ({which}). Each rank holds its own "
                         "rows of the optimizer state, so an optimizer given on some ranks only would be "
                         f"{'saved' if what == 'save_checkpoint' else 'restored'} there alone and each rank's rows "
                         "would step from another state. Nothing was written or read. Fix: pass the same arguments "
                         "on every rank (the optimizer on all of them, or on none).")
