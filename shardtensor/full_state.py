"""Full (unsharded) state dicts of a sharded model: ``full_state_dict`` gathers them, ``load_full_state_dict`` loads
one all or nothing.  (``model.state_dict()`` keeps each rank's rows: DCP's and per-rank files' way.)"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from . import _comm
from ._full import gather_full
from .tensor import ShardedParam


def _uncompiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper wraps (``OptimizedModule``, whose own keys start ``_orig_mod.``): the
    full state dict of a compiled model has the unsharded model's keys, as DCP's ``get_model_state_dict`` gives."""
    while type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
        module = module._orig_mod
    return module


def _without_compile_wrappers(key: str) -> str:
    """``key`` without the ``_orig_mod`` segments of compile wrappers inside the model (regional compilation,
    ``model.blocks[i] = torch.compile(block)``), as torch's ``get_model_state_dict`` names it."""
    return ".".join(part for part in key.split(".") if part != "_orig_mod")


@torch.no_grad()
def full_state_dict(module: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Plain full tensors with the keys of the unsharded ``module.state_dict()`` (of the model a ``torch.compile``
    wrapper wraps; without the ``_orig_mod.`` of wrappers inside it, as ``get_model_state_dict`` gives them, so the
    plain model loads them).  Gathers one tensor at a time.

    Args:
        rank0_only: only rank 0 of the module's group keeps the tensors (a single-file ``torch.save``); the
            other ranks take part in the gathers, hold one full tensor at a time, and get ``{}``.
            (Default: ``False``: every rank gets the full state dict.)
    """
    module = _uncompiled(module)
    keep = not rank0_only or _comm.rank(getattr(getattr(module, "_shardtensor", None), "group", None)) == 0
    out = {}
    for key, value in module.state_dict().items():
        key = _without_compile_wrappers(key)
        if isinstance(value, ShardedParam):
            full = gather_full(value)  # every rank takes part
            if keep:
                out[key] = full.clone()
        elif keep:  # a copy too: a snapshot (best model, EMA) must not follow a BatchNorm's statistics on
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value  # while the rest stays put
    return out


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """Load a full (unsharded) state dict: each rank keeps its rows.

    Everything is checked before anything is copied, so a bad state dict leaves the model as it was: missing and
    unexpected keys (when ``strict``), non-tensor values, shapes, and dtypes (``load_state_dict`` would cast a
    float64 or integer tensor silently; a checkpoint of another dtype is more often the wrong file than a wish).
    The verdicts are agreed (one exchange): a file bad on one rank only is refused on every rank, and so are
    ranks that would load different keys (``strict=False`` with the dict on rank 0 only: the ranks then ran
    different collectives, one of them returned as if loaded).
    """
    module = _uncompiled(module)
    own = module.state_dict()
    aliases = {_without_compile_wrappers(k): k for k in own}  # (a full state dict's keys, or torch's own)
    state_dict = {k if k in own else aliases.get(k, k): v for k, v in state_dict.items()}
    error = _full_state_dict_error(own, state_dict, strict)
    group = getattr(getattr(module, "_shardtensor", None), "group", None)
    loading = sorted(state_dict.keys() & own.keys())
    keys_digest = hashlib.sha256("\n".join(loading).encode()).hexdigest()
    verdicts = _comm.all_gather_object((error, len(loading), keys_digest), group,
                                       label="load_full_state_dict: the ranks' verdicts")
    if not error and any(e for e, _, _ in verdicts):
        error = ("load_full_state_dict: another rank refused its state dict (its error names the key); nothing "
                 "was copied on any rank.")
    elif not error and len({digest for _, _, digest in verdicts}) > 1:
        counts = ", ".join(f"rank {r}: {n}" for r, (_, n, _) in enumerate(verdicts))
        error = (f"load_full_state_dict: the ranks' state dicts hold different keys of the model ({counts} keys); "
                 "nothing was copied on any rank. Every rank keeps its rows of the same full tensors, so every "
                 "rank needs the same full state dict. Fix: pass it on every rank (full_state_dict(model) without "
                 "rank0_only, or torch.load of the file on every rank).")
    if error:
        raise ValueError(error)
    return module.load_state_dict(state_dict, strict=strict)


def _full_state_dict_error(own: dict, state_dict: dict, strict: bool) -> str:
    if strict:
        missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
        if missing or unexpected:
            return (f"load_full_state_dict: keys do not match the model: missing {missing[:5]}"
                    f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                    f"{'...' if len(unexpected) > 5 else ''}. Fix: load the checkpoint of this architecture, or pass "
                    "strict=False to load the matching keys only.")
    for key, value in state_dict.items():
        if key not in own:
            continue
        if not isinstance(value, torch.Tensor):
            return f"load_full_state_dict: {key!r} is a {type(value).__name__}, not a tensor"
        if tuple(own[key].shape) != tuple(value.shape):
            return (f"load_full_state_dict: {key!r} has shape {tuple(value.shape)} in the state dict but "
                    f"{tuple(own[key].shape)} in the model")
        if own[key].dtype != value.dtype:
            return (f"load_full_state_dict: {key!r} is {value.dtype} in the state dict but {own[key].dtype} in the "
                    f"model. Fix: cast it first if that is intended ({{k: v.to(dtype) ...}}).")
    return ""
