"""Distributed checkpoints: each rank writes its rows, any world size reads them back (resharding).

    shardtensor.save_checkpoint(path, model, opt)        # torch.distributed.checkpoint, one file per rank
    shardtensor.load_checkpoint(path, model, opt)        # world size may differ from the one that saved

[Note: why DTensors in the state dict]
``torch.distributed.checkpoint`` (DCP) reshards by itself when every tensor says which global rows it holds: a
DTensor does.  ``ShardedParam.to_dtensor()`` gives one over this rank's valid rows (a view, no copy), so DCP
saves exactly the unpadded rows and, on load, copies the overlapping rows of whatever ranks saved into the
views, i.e. into the shards in place.  Resharding W -> W' is therefore DCP's, and bit-exact (rows are copied,
never recomputed).  Optimizer state is keyed by parameter name (not by position) so it survives a model that
registers its parameters in another order; its ShardedParam tensors (Adam's moments) go the same way, and
replicated scalars (``step``) are saved once.

Loads are all-or-nothing: see [Note: all-or-nothing loads] in ``checkpoint_verify.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from . import _comm
from .checkpoint_files import CheckpointError
from .checkpoint_verify import file_records, read_metadata_unverified, verify, write_sidecar
from .tensor import ShardedParam

_MODEL, _OPTIM = "model", "optim"


# ---------------------------------------------------------------------------------------------- state dicts
def sharded_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every ShardedParam as a ``Shard(0)`` DTensor over this rank's rows (no copy).

    Pass it to ``torch.distributed.checkpoint.save``; ``torch.distributed.checkpoint.load`` into it writes the
    loaded rows into the module's shards in place.
    """
    return {key: _as_dtensor(value) for key, value in module.state_dict().items()}


def _as_dtensor(value):
    return value.to_dtensor() if isinstance(value, ShardedParam) else value


def _param_names(module: nn.Module) -> dict[int, str]:
    """id(param) -> its first fully qualified name (tied parameters appear once)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    return names


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, ShardedParam states as DTensors (no copy).

    ``{"state": {name: {"exp_avg": DTensor, "step": tensor, ...}}, "param_groups": [{..., "params": [names]}]}``
    """
    names = _param_names(module)
    state: dict[str, dict] = {}
    groups = []
    for group in optimizer.param_groups:
        group_names = []
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"sharded_optimizer_state_dict: the optimizer holds a parameter of shape {tuple(param.shape)} "
                    f"that is not in {type(module).__name__} (build the optimizer on model.parameters())"
                )
            name = names[id(param)]
            group_names.append(name)
            if param in optimizer.state:
                state[name] = {k: _as_dtensor(v) for k, v in optimizer.state[param].items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (a step with zero gradients and lr 0) so there is something to load
    into; torch.distributed.checkpoint.state_dict does the same.  Parameters do not change: lr is 0."""
    if optimizer.state:
        return
    saved = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        saved.append(lr)
        group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr
        for param in group["params"]:
            param.grad = None


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
        raise CheckpointError(f"{path}: torch.distributed.checkpoint.{what} failed: {type(exc).__name__}: "
                              f"{str(exc)[:500]}") from exc


def save_checkpoint(path: str | os.PathLike, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Save the module (and optimizer) shards with ``torch.distributed.checkpoint`` into directory ``path``, and
    the checksums of every file and item beside them (``shardtensor.checksums.json``).

    A collective: every rank calls it with the same ``path`` (a shared file system across hosts).
    """
    import torch.distributed.checkpoint as dcp

    state = {_MODEL: sharded_state_dict(module)}
    if optimizer is not None:
        state[_OPTIM] = sharded_optimizer_state_dict(module, optimizer)
    _dcp(lambda: dcp.save(state, checkpoint_id=os.fspath(path)), "save", path)
    group, directory = _group(module), Path(path)
    rank, world = _comm.rank(group), _comm.world_size(group)
    mine = file_records(directory, read_metadata_unverified(directory), rank, world)  # each file hashed once
    files: dict = {}
    for part in _comm.all_gather_object(mine, group, label="save_checkpoint (collecting checksums)"):
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

    group, directory = _group(module), Path(path)
    fresh = optimizer is not None and not optimizer.state
    error = ""
    try:
        metadata = verify(directory, _comm.rank(group), _comm.world_size(group)) if verify_checksums \
            else read_metadata_unverified(directory)
        state = {_MODEL: sharded_state_dict(module)}
        if optimizer is not None:
            _init_optimizer_state(optimizer)  # something to load into (undone below if the load is refused)
            state[_OPTIM] = sharded_optimizer_state_dict(module, optimizer)
            _check_param_groups(metadata, optimizer)
        _check_against_metadata(metadata, state, strict)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the verdict exchange
        error = str(exc) if isinstance(exc, CheckpointError) else f"{path}: {type(exc).__name__}: {exc}"
    errors = [e for e in _comm.all_gather_object(error, group, label="load_checkpoint (exchanging verdicts)") if e]
    if errors:
        if fresh:
            optimizer.state.clear()  # the zero state made to load into: the optimizer is as it was
        raise CheckpointError("load_checkpoint: nothing was loaded: " + " | ".join(dict.fromkeys(errors)))
    _dcp(lambda: dcp.load(state, checkpoint_id=os.fspath(path)), "load", path)
    _copy_back(module.state_dict(), state[_MODEL])
    if optimizer is not None:
        _restore_optimizer(module, optimizer, state[_OPTIM])


def _check_param_groups(metadata, optimizer: torch.optim.Optimizer) -> None:
    prefix = f"{_OPTIM}.param_groups."
    saved = {key[len(prefix):].split(".", 1)[0] for key in metadata.state_dict_metadata if key.startswith(prefix)}
    if saved and len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"load_checkpoint: the checkpoint has {len(saved)} optimizer param groups, the "
                              f"optimizer {len(optimizer.param_groups)}")


def _check_against_metadata(metadata, state: dict, strict: bool) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key not in saved:
            raise CheckpointError(f"load_checkpoint: {key!r} is not in the checkpoint (it has {len(saved)} entries, e.g. "
                             f"{sorted(saved)[:3]}); was it saved from another model?")
        meta = saved[key]
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.shape):
            shape = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else type(meta).__name__
            raise CheckpointError(f"load_checkpoint: {key!r} has shape {shape} in the checkpoint but "
                                  f"{tuple(value.shape)} in the model")
        if meta.properties.dtype != value.dtype:
            raise CheckpointError(f"load_checkpoint: {key!r} is {meta.properties.dtype} in the checkpoint but "
                                  f"{value.dtype} in the model")
    if strict:
        extra = sorted(k for k, m in saved.items() if k.startswith(_MODEL + ".") and k not in flat
                       and isinstance(m, TensorStorageMetadata))
        if extra:
            raise CheckpointError(f"load_checkpoint: the checkpoint has tensors the model lacks: {extra[:5]} "
                             "(pass strict=False to ignore them)")


def _copy_back(own: dict, loaded: dict) -> None:
    """DCP loads into the given tensors in place; copy anything it replaced instead (e.g. a non-tensor value)."""
    for key, value in loaded.items():
        target = own.get(key)
        if isinstance(target, ShardedParam):
            local = value.to_local() if hasattr(value, "to_local") else value
            rows = target._layout.valid_rows
            if rows and local.data_ptr() != target._local.data_ptr():
                target._local[:rows].copy_(local)
        elif isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor) and value is not target:
            target.copy_(value)


def _restore_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    by_name = dict(module.named_parameters())  # tied parameters under their first name, as _param_names
    if len(loaded["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"load_checkpoint: the checkpoint has {len(loaded['param_groups'])} optimizer param groups, "
                         f"the optimizer {len(optimizer.param_groups)}")
    for name, values in loaded["state"].items():
        param = by_name[name]
        current = optimizer.state[param]
        for key, value in values.items():
            target = current.get(key)
            if isinstance(target, ShardedParam):
                local = value.to_local()
                rows = target._layout.valid_rows
                if rows and local.data_ptr() != target._local.data_ptr():
                    target._local[:rows].copy_(local)
            elif isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
                if value is not target:
                    target.copy_(value)
            else:
                current[key] = value
    for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
        for key, value in saved.items():
            if key == "params":
                continue
            if isinstance(group.get(key), torch.Tensor) and not isinstance(value, torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = value

