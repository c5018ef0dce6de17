"""Full tensors written into shards must be the same on every rank.

[Note: full tensors written into shards]
``p.copy_(t)``, ``p.data = t``, ``model.load_state_dict(sd)`` and ``nn.init.normal_(p)`` take a tensor of the
parameter's full shape on every rank and keep this rank's rows of it.  When ``t`` differs between ranks (each
rank loaded another file, computed it from its own batch, or drew it from its own generator), nothing fails and
the parameter becomes a patchwork of the ranks' tensors.  Before such a write the ranks exchange a digest of up
to 1024 sampled elements (one small all-gather, checked like every collective): a write of differing tensors is
refused on every rank, naming the parameter, before anything is copied; a random draw takes rank 0's (any draw
is a valid init, and rank 0's is the one the unsharded model on rank 0 would make).  The exchange also turns a
write on some ranks only (``if rank == 0: model.load_state_dict(sd)``), a patchwork once more, into a named
divergence at the next collective of the others.  ``load_state_dict`` checks all its tensors in one exchange in
its pre-hook, before the first copy (a failed load changes nothing); the copies it then makes are not checked
again.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Optional

import torch
from torch import nn

from . import _comm
from ._dtensor_loads import take_dtensors
from ._frames import caller_frame

_AGREED: dict[int, "weakref.ref"] = {}  # tensors a load_state_dict pre-hook has checked, until its post-hook


def _sample_digest(p: torch.Tensor) -> str:
    """A digest of up to 1024 evenly spaced elements (and the shape): enough to tell differently seeded or
    loaded weights apart, at the cost of a gather of samples, not a read of the model.  Empty for meta tensors."""
    if p.is_meta or p.numel() == 0:
        return ""
    flat = p.detach().reshape(-1)
    count = min(flat.numel(), 1024)  # integer steps: float32 linspace rounds past the last index of a big tensor
    index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
    sample = flat[index].cpu()
    sample = torch.view_as_real(sample) if sample.is_complex() else sample
    return hashlib.blake2b(sample.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


def _digest(t: torch.Tensor) -> int:
    if not is_plain(t):  # a ShardedParam: each rank holds its own rows, and reading samples would gather
        return 0
    text = _sample_digest(t)
    return int(text, 16) - (1 << 63) if text else 0


def _group_and_world(param) -> tuple:
    group = getattr(param._layout, "group", None)
    return group, (_comm.world_size(group) if _comm.is_distributed() else 1)


def differing(items: list, what: str, refusal: str = "") -> list:
    """Names of ``items`` (``(name, param, full)`` of one group) whose full tensors differ between ranks; ``[None]``
    if another rank refuses the write (its flag rides first in the exchange: 2 for a ``RuntimeError``, torch's
    load errors, and ``[None, RuntimeError]`` then, so every rank raises the type a handler expects)."""
    if not items:
        return []
    group, world = _group_and_world(items[0][1])
    if world == 1:
        return []
    flag = 2 if isinstance(refusal, RuntimeError) else int(bool(refusal))
    mine = torch.tensor([flag] + [_digest(full) for _, _, full in items], dtype=torch.int64,
                        device=items[0][1]._local.device)
    label = f"{what}: digests of the full tensors of {items[0][0]!r}" + (
        f" and {len(items) - 1} more" if len(items) > 1 else "")
    everyone = _comm.all_gather_rows(mine.unsqueeze(0), group, label=label).buffer.cpu()
    if bool(everyone[:, 0].any()):
        return [None, RuntimeError] if int(everyone[:, 0].max()) == 2 else [None]
    return [items[k][0] for k in range(len(items)) if not bool((everyone[:, k + 1] == everyone[0, k + 1]).all())]


def refuse_differing(items: list, what: str, refusal: str = "") -> None:
    """Raise on every rank, before anything is copied, if any full tensor of ``items`` differs between ranks, or
    if any rank refuses the write (``refusal``, its reason, rides in the same exchange as a flag)."""
    by_group: dict = {}
    for item in items:
        if _AGREED.get(id(item[2]), lambda: None)() is not item[2]:
            by_group.setdefault(id(getattr(item[1]._layout, "group", None)), []).append(item)
    for group_items in by_group.values():
        names = differing(group_items, what, refusal)
        if refusal:
            raise refusal if isinstance(refusal, Exception) else ValueError(refusal)
        if names and names[0] is None:
            error = names[-1] if len(names) > 1 else ValueError
            raise error(f"{what}: another rank refused it (its error names the tensor and the fix), so no "
                        "rank copies anything: a load is all ranks' or none's.")
        if names:
            raise ValueError(
                f"{what}: the full tensor written into the sharded parameter {names[0]!r}"
                f"{f' (and {len(names) - 1} more)' if len(names) > 1 else ''} differs between ranks, so each rank "
                "would keep its rows of another tensor (a patchwork). Nothing was copied. Fix: write the same "
                "tensor on every rank (load the same file, seed alike, or dist.broadcast(t, 0) first), and run "
                "the write on every rank.")
    if refusal:  # every tensor already agreed (a second load of the same dict): refused all the same
        raise refusal if isinstance(refusal, Exception) else ValueError(refusal)


def any_rank(flag: bool, group, label: str) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (one flag all-reduce; this rank's own where there is no
    other): a verdict every rank acts on alike, so a refusal on one rank is a refusal on all."""
    if not _comm.is_distributed() or _comm.world_size(group) == 1:
        return flag
    verdict = torch.tensor([float(flag)])
    _comm.all_reduce(verdict, group, op="max", label=label)
    return bool(verdict.item())


def is_plain(t) -> bool:
    """A plain tensor, the same object on every rank only by the user's doing (not a ShardedParam or DTensor,
    whose reads communicate)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


# [Note: rank 0's weights]
# Each rank keeps its own rows of what it built, so weights that differ between ranks would make the model a
# patchwork of the ranks' models, and a parameter kept whole on every rank (0-d, persist_numel) would never agree.
# They differ more often than one thinks: torch seeds each new process's generator at random, so a script that
# never calls torch.manual_seed builds another model on every rank (DDP hides it by broadcasting rank 0's
# weights at construction).  shard_module does what DDP does, but only for the parameters whose digests differ
# (a digest of up to 1024 evenly spaced elements rides in the plan check): rank 0's values, broadcast in place.
# A random init after shard_module (``take_rank0_draw``) takes rank 0's draw the same way.
def take_rank0_values(named: list, group, what: str = "shard_module") -> None:
    """Rank 0's values of each ``(name, tensor)``, broadcast in place."""
    with torch.no_grad():
        for name, p in named:
            contiguous = p.is_contiguous()
            buffer = p.detach() if contiguous else p.detach().contiguous()  # the former shares p's storage
            buffer = buffer.view(torch.uint8) if buffer.dtype == torch.bool else buffer  # (gloo has no bool)
            _comm.broadcast(buffer, 0, group, label=f"{what}: rank 0's values of {name!r}")
            if not contiguous:
                p.detach().copy_(buffer.view(p.dtype))


def take_rank0_draw(param, full: torch.Tensor) -> None:
    """``nn.init.normal_(p)`` and friends draw ``full`` from this rank's generator: where the ranks' draws
    differ, every rank takes rank 0's (broadcast in place)."""
    if differing([(param._name, param, full)], f"nn.init of {param._name!r}"):
        take_rank0_values([(param._name, full)], _group_and_world(param)[0], what="nn.init")


def agree_on_load(params: dict, root: bool, module, state_dict: dict, prefix: str, *args) -> None:
    """Load pre-hook of the sharded root and of each module above a sharded parameter (``params``: the module's
    sharded parameters by name, its subtree's): every full tensor headed for them, in one exchange.  The first
    hook of a load checks all of its tensors; the hooks of the modules below find them agreed (torch copies a
    module's parameters and catches what ``copy_`` raises, so the per-copy check alone would leave a load half
    done, and a load on one rank only waiting at every parameter).  The first hook also finds what torch itself
    would refuse (see ``torch_load_errors``), so that refusal too comes before the first copy, on every rank."""
    if root:
        _AGREED.clear()
    items, refusal = [], None
    shard_refusal = take_dtensors(params, state_dict, prefix) or None  # (FSDP2's DTensor state dicts)
    for name, param in params.items():
        value = state_dict.get(prefix + name)
        if is_plain(value) or hasattr(value, "_layout"):  # (a wrong shape is refused below, on every rank)
            items.append((param._name or name, param, value))  # the message names it as the model does
            shard_refusal = shard_refusal or _other_ranks_shard(prefix + name, value)
    if root or not prefix:  # the module load_state_dict was called on (or the sharded root below a wrapper)
        errors = torch_load_errors(module, state_dict, prefix)
        caller, given = _strict_load_caller(module)
        if caller is not None and (caller is module or prefix):  # a wrapper's load: its keys too
            errors += torch_key_errors(caller, given)
        if args and args[0].get("assign_to_params_buffers") and params:
            refusal = ValueError(
                "load_state_dict(assign=True) would put the state dict's tensors in place of the sharded "
                f"parameters (first {next(iter(params))!r}): they would lose their gradient hooks and gathers. "
                "Nothing was copied on any rank. Fix: load without assign=True (each rank copies its rows of the "
                "full tensors in place); for a meta-device model, shardtensor.materialize(model) first.")
        elif any(p._local.is_meta for p in params.values()):
            name = next(n for n, p in params.items() if p._local.is_meta)
            refusal = ValueError(
                f"load_state_dict: sharded parameter {name!r} is still on the meta device (the model was built under "
                "torch.device('meta')), so there are no rows to copy into. Nothing was copied on any rank. Fix: "
                "shardtensor.materialize(model, device=...) first (shardtensor's to_empty), then load.")
        elif errors:
            owner = type(module if caller is None else caller).__name__
            refusal = RuntimeError(
                f"Error(s) in loading state_dict for {owner}:\n\t" + "\n\t".join(errors) +
                "\nNothing was copied on any rank (torch copies the other tensors before it raises; a sharded "
                "model's load is all or nothing).")
        _refuse_on_every_rank(refusal, params, len(items))
    refuse_differing(items, "load_state_dict", refusal or shard_refusal)
    for _, _, value in items:
        _AGREED[id(value)] = weakref.ref(value)


def _refuse_on_every_rank(refusal: Optional[Exception], params: dict, loading: int) -> None:
    """Raise ``refusal`` here, and on every other rank of the parameters' group an error of the same type, before
    anything is copied: one flag exchange (0: none; 1: a ``ValueError``; 2: a ``RuntimeError``, torch's load
    errors, so an ``except RuntimeError`` around the load catches it on every rank).  A refusal decided on one
    rank alone (only its dict has renamed keys) left the others waiting in the digest exchange.  The same
    exchange carries how many sharded tensors each rank loads: with ``strict=False`` and the full dict on rank 0
    only, rank 0 went on to the digests while the others returned as if loaded."""
    if not params:
        if refusal is not None:
            raise refusal
        return
    group, world = _group_and_world(next(iter(params.values())))
    flag = 0 if refusal is None else 2 if isinstance(refusal, RuntimeError) else 1
    most = fewest = loading
    if world > 1:
        verdict = torch.tensor([float(flag), float(loading), -float(loading)])
        _comm.all_reduce(verdict, group, op="max", label="load_state_dict: whether any rank refuses the load")
        flag, most, fewest = int(verdict[0].item()), int(verdict[1].item()), -int(verdict[2].item())
    if refusal is not None:
        raise refusal
    if most != fewest and not flag:
        raise ValueError(
            f"load_state_dict: this rank's state dict holds {loading} of the sharded parameters, another rank's "
            f"{fewest if loading == most else most}, so no rank copies anything: every rank keeps its rows of the "
            "same full tensors, and needs the same full state dict. Fix: load the same dict on every rank "
            "(torch.load the file on every rank, or shardtensor.full_state_dict(model) without rank0_only).")
    if flag:
        raise (RuntimeError if flag == 2 else ValueError)(
            "load_state_dict: another rank refused it (its error names the keys or tensors and the fix), so no "
            "rank copies anything: a load is all ranks' or none's.")


def _strict_load_caller(module) -> tuple:
    """``(module, state dict)`` of the ``load_state_dict(..., strict=True)`` that runs this hook (``module``
    itself, or a wrapper around it), or ``(None, None)``: torch hands every module's load ``strict=True``, a
    child only its own keys, and applies the caller's ``strict`` at the end, so both are read from the nearest
    ``load_state_dict`` frame (none found: torch decides, as before)."""
    frame = caller_frame(lambda f: f.f_code is nn.Module.load_state_dict.__code__)
    if frame is None:
        return None, None
    caller, given = frame.f_locals.get("self"), frame.f_locals.get("state_dict")
    if frame.f_locals.get("strict", True) and isinstance(caller, nn.Module) and isinstance(given, dict):
        return caller, given
    return None, None


def torch_key_errors(module, state_dict: dict) -> list[str]:
    """The missing and unexpected keys ``strict=True`` reports, by torch's own per-module rules, found before the
    first copy (torch copies every other tensor first, then raises: a half-loaded model).  Only where every module
    loads the plain way: a load pre- or post-hook or a ``_load_from_state_dict`` of a module's own may rename,
    consume or forgive keys, and torch decides there.  A norm layer's missing ``num_batches_tracked`` is filled
    in by the layer, not reported."""
    from torch.nn.modules.batchnorm import _NormBase

    missing, unexpected = [], set()
    for name, sub in module.named_modules(remove_duplicate=False):
        if any(not _is_ours(h) for h in sub._load_state_dict_pre_hooks.values()) or \
                any(h is not loaded for h in sub._load_state_dict_post_hooks.values()) or \
                type(sub)._load_from_state_dict not in (nn.Module._load_from_state_dict,
                                                        _NormBase._load_from_state_dict):
            return []
        prefix = f"{name}." if name else ""
        local = {k for k, v in {**sub._parameters, **{k: v for k, v in sub._buffers.items()
                                                       if k not in sub._non_persistent_buffers_set}}.items()
                 if v is not None}
        if any(nn.parameter.is_lazy(getattr(sub, k)) for k in local):
            return []
        missing += [prefix + k for k in local if prefix + k not in state_dict and k != "num_batches_tracked"]
        extra, takes_extra = prefix + "_extra_state", type(sub).set_extra_state is not nn.Module.set_extra_state
        if takes_extra and extra not in state_dict:
            missing.append(extra)
        for key in state_dict:
            if key.startswith(prefix) and (key != extra or not takes_extra) and \
                    key[len(prefix):].split(".", 1)[0] not in sub._modules.keys() | local:
                unexpected.add(key)
    errors = []
    if unexpected:
        errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected)) + ". ")
    if missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing)) + ". ")
    return errors


def torch_load_errors(module, state_dict: dict, prefix: str) -> list[str]:
    """The errors torch's ``load_state_dict`` would report for ``module``'s tensors, whatever ``strict`` is: a
    value that is not a tensor, a shape that differs (a checkpoint of another vocabulary size).  torch finds them
    while it copies, and raises after copying every other tensor: the model is then half the checkpoint's.
    Modules that load their own way (a ``_load_from_state_dict`` of their own, but for the norm layers', which
    only add a missing counter, or a load pre-hook of their own, below them too) are left to torch."""
    from torch.nn.modules.batchnorm import _NormBase

    plain_loads = (nn.Module._load_from_state_dict, _NormBase._load_from_state_dict)
    errors, adapted = [], []  # modules with load pre-hooks of their own (a legacy layout transposed back, keys
    for module_name, sub in module.named_modules(remove_duplicate=False):  # renamed): their subtrees are torch's
        if any(not _is_ours(hook) for hook in sub._load_state_dict_pre_hooks.values()):
            adapted.append(module_name)
        if type(sub)._load_from_state_dict not in plain_loads or any(
                a == "" or module_name == a or module_name.startswith(a + ".") for a in adapted):
            continue
        tensors = {**sub._parameters, **{k: v for k, v in sub._buffers.items()
                                         if k not in sub._non_persistent_buffers_set}}
        for name, tensor in tensors.items():
            key = prefix + (f"{module_name}." if module_name else "") + name
            value = state_dict.get(key)
            if tensor is None or value is None or nn.parameter.is_lazy(tensor):
                continue
            if not torch.overrides.is_tensor_like(value):
                errors.append(f"{key!r} is a {type(value).__name__}, not a tensor")
            elif tuple(value.shape) != tuple(tensor.shape) and not (tensor.dim() == 0 and tuple(value.shape) == (1,)):
                errors.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                              f"checkpoint, the shape in current model is {tuple(tensor.shape)}")
    return errors


def _is_ours(hook) -> bool:
    inner = getattr(hook, "hook", hook)  # torch wraps a registered hook
    return getattr(inner, "func", None) is agree_on_load


def _other_ranks_shard(key: str, value) -> str:
    """Why this rank cannot load ``value``, if it is a ShardedParam pickled by another rank: ``torch.save(model.
    state_dict())`` on one rank keeps only that rank's rows.  On the saving rank it would load, and every other
    rank refuses it; the refusal rides in the load's exchange so that every rank raises (a ``try``/``except``
    around the load, falling back to a fresh start on some ranks only, was a patchwork of old and new rows)."""
    layout = getattr(value, "_layout", None)
    saved = (getattr(layout, "rank", None), getattr(layout, "world", None))
    group = getattr(layout, "group", None)  # (an unpickled shard has lost its group: the global rank and world)
    here = (_comm.rank(group), _comm.world_size(group)) if _comm.is_distributed() else (0, 1)
    if layout is None or None in saved or saved == here:
        return ""
    return (f"load_state_dict: {key!r} is rank {saved[0]}'s shard of a {saved[1]}-rank run (model.state_dict() of "
            f"a sharded model holds each rank's own rows, and torch.save on one rank keeps only that rank's), but "
            f"this is rank {here[0]} of {here[1]}. Nothing was copied on any rank. Fix: shardtensor.save_checkpoint("
            "dir, model, opt) / load_checkpoint (any world size), or save shardtensor.full_state_dict(model, "
            "rank0_only=True) (called on every rank) and load those full tensors with model.load_state_dict on "
            "every rank.")


def loaded(*args) -> None:
    """Load post-hook: the tensors checked by ``agree_on_load`` are checked no longer."""
    _AGREED.clear()
