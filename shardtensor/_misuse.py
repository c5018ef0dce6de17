"""Guards against the common mistakes of porting a training script: each one would otherwise train on without a
word and give wrong numbers.  ``shard_module`` and the root forward pre-hook call these (mistakes seen at
``opt.step()``: ``_misuse_optim``).

- a parameter that overlaps another one's memory (a view): sharding each separately breaks the aliasing
  (refused at ``shard_module``, naming both);
- a model built on the meta device and never materialised: the first forward would compute on uninitialised
  memory (refused at the first forward);
- ``torch.save(model.state_dict())`` on rank 0, ``load_state_dict(torch.load(...))`` on every rank (DDP's habit):
  the file holds rank 0's shards only, and another rank would gather them alone (refused before anything is
  copied, naming the key);
- a parameter used only in a deferred micro-batch: the synced backward never reaches its hook, so its deferred
  gradient is reduced at the end of that backward (``flush_deferred``);
- ranks that shard different models, or the same model with other settings (``gather=``, ``prefetch_bytes``,
  ...): their collectives would disagree (refused at ``shard_module``, naming the difference);
- a model converted, parametrized or given new trainable parameters after ``shard_module``: the new tensors have
  no gradient reduction, so the ranks' copies drift apart (refused at the next forward, naming the parameter); a
  conversion that changes nothing gets its gradient hooks back.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import _comm, _grad_landing
from ._hooks import DEEPCOPY_REFUSAL, PICKLE_REFUSAL, PickleRefusingHook  # noqa: F401  (re-exported)
from ._agreement import _sample_digest, take_rank0_values

log = logging.getLogger("shardtensor")


# ------------------------------------------------------------------------------------------- at shard_module
def refuse_plain_grad_in_unit(p) -> None:
    """A unit adds its reduced rows to ``p.grad``; a hook that made it a full plain tensor is named here."""
    if type(p.grad) is not type(p):
        raise TypeError(
            f"the gradient of sharded parameter {p._name!r} is a plain {type(p.grad).__name__} of shape "
            f"{tuple(p.grad.shape)}, so its reduced rows have nowhere to go: a full tensor was put in .grad during "
            "backward (by a hook registered through torch.Tensor.register_hook(p, ...) or by assignment), before "
            "the gather unit's reduction landed. Use p.register_hook (its hooks run on the reduced, sharded "
            "gradient), or change gradients after backward() (p.grad is sharded: p.grad.mul_(c), p.grad.to_local())")


def refuse_persisted_with_param_dtype(module: nn.Module, persist_numel: int, param_dtype) -> None:
    """Parameters kept whole (``persist_numel``) are never gathered, so nothing casts them to ``param_dtype``:
    the first op that meets them beside the cast weights failed with torch's "Float and BFloat16"."""
    kept = [n for n, p in module.named_parameters() if param_dtype is not None and p.is_floating_point()
            and 0 < p.numel() < persist_numel and p.dtype != param_dtype]
    if kept:
        raise ValueError(f"shard_module: persist_numel={persist_numel} keeps {kept[0]!r} (and {len(kept) - 1} more) "
                         f"whole in {module.get_parameter(kept[0]).dtype}, and param_dtype={param_dtype} casts only "
                         "the gathered parameters: the forward would meet both in one op. Fix: persist_numel=0 "
                         "with param_dtype, or param_dtype=None and the forward under torch.autocast.")


def refuse_before_sharding(module: nn.Module) -> None:
    """Checks that need the parameters as they are before ``shard_module`` replaces any of them."""
    _refuse_overlapping_parameters(module)


_REDUCERS_IN_USE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # reducer -> weakref(module)


def refuse_shared_reducer(reducer, module: nn.Module) -> None:
    """One reducer with per-parameter state (``CompressedReducer``'s error feedback, keyed by parameter name)
    passed to two ``shard_module`` calls: the two models' ``'fc1.weight'`` would share one error buffer, each
    feeding its quantization error into the other's gradients, silently (a GAN, actor and critic)."""
    if reducer is None or not getattr(reducer, "keeps_state_per_parameter", False):
        return
    owner = _REDUCERS_IN_USE.get(reducer)
    if owner is not None and owner() is not module:  # (unsharded or deleted since: its buffers are still there)
        raise ValueError(
            f"shard_module: this {type(reducer).__name__} already reduced another model's gradients, and it keeps "
            "state per parameter name (error feedback): two models' parameters of the same name would share it. "
            f"Fix: pass a new {type(reducer).__name__}(...) to each shard_module call.")
    _REDUCERS_IN_USE[reducer] = weakref.ref(module)


def _extent(p: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) of ``p`` in its storage."""
    size = p.element_size()
    last = sum((n - 1) * s for n, s in zip(p.shape, p.stride()) if n > 0)
    return p.storage_offset() * size, (p.storage_offset() + last + 1) * size


def _refuse_overlapping_parameters(module: nn.Module) -> None:
    """Two Parameter objects over overlapping memory (``b = nn.Parameter(a.detach()[2:4])``) are one tensor to
    the unsharded model: a write to one shows in the other.  Sharded, each gets its own shard and the link is
    gone (the model silently computes something else), so refuse, naming both.  Tied parameters (one object
    under two names) are fine: they stay one ShardedParam."""
    spans = []
    for name, p in module.named_parameters():
        if p.is_meta or p.numel() == 0 or type(p) not in (nn.Parameter, torch.Tensor):
            continue
        start, end = _extent(p)
        spans.append((p.untyped_storage().data_ptr(), start, end, name))
    spans.sort()
    for (ptr0, _, end0, name0), (ptr1, start1, _, name1) in zip(spans, spans[1:]):
        if ptr0 == ptr1 and start1 < end0:
            raise ValueError(
                f"shard_module: parameters {name0!r} and {name1!r} share memory (one is a view of the other). "
                "Sharded, each would get its own copy and the aliasing would silently break. Fix: keep one "
                f"parameter and compute the other from it in forward (e.g. self.{name0.rsplit('.', 1)[-1]}[...]), "
                "or tie them as the same nn.Parameter object."
            )


# ------------------------------------------------------------------------------------------- at the first forward
class MaterializedCheck:
    """Root forward pre-hook part: until one forward has found every parameter and buffer allocated, check that
    none is still on the meta device (built under ``torch.device("meta")``, ``materialize`` not yet called).
    Gathers of meta shards would otherwise run forward and backward on uninitialised memory."""

    def __init__(self) -> None:
        self.done = False

    def __call__(self, module: nn.Module) -> None:
        if self.done:
            return
        refuse_meta_tensors(module)
        self.done = True


def refuse_meta_tensors(module: nn.Module) -> None:
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise RuntimeError(
                    f"shardtensor: {kind} {name!r} is on the meta device (the model was built under "
                    "torch.device('meta') and never materialised), so forward would compute on uninitialised "
                    "memory. Fix: call shardtensor.materialize(model) (or materialize(model, init_fn)) after "
                    "shard_module and before the first forward."
                )


# ------------------------------------------------------------------------------------- deferred gradient sync
_DEFERRING: "weakref.WeakSet" = weakref.WeakSet()  # GradSyncs that hold deferred gradients


def note_deferred(grad_sync, key: str, owner) -> None:
    """``GradSync._defer`` kept a full local gradient under ``key``; ``owner`` says where its reduced value goes:
    ``(param, layout)`` for a sharded parameter, ``(param, group)`` for a replicated one."""
    owners = grad_sync.__dict__.setdefault("_deferred_owner", {})
    if owner is not None:
        owners[key] = owner
    _DEFERRING.add(grad_sync)


@torch.no_grad()
def flush_deferred(grad_sync) -> None:
    """Reduce every deferred gradient the synced backward did not reach (a parameter used only in a deferred
    micro-batch) and add it to ``.grad``, as if that backward had reached it.  Keys go in deferral order, which is
    the backward's hook order and so the same on every rank: the collectives match."""
    from ._layout import ShardLayout
    from .tensor import ShardedParam

    owners = grad_sync.__dict__.get("_deferred_owner", {})
    for key in [k for k in grad_sync._deferred if k in owners and isinstance(owners[k][1], ShardLayout)]:
        param, where = owners.pop(key)
        kept = grad_sync.take_deferred(key, grad_sync._deferred.pop(key), param)
        if kept is None:  # zero_grad() threw it away
            continue
        shard = grad_sync.strategy.reduce_grad(kept, where, key=key, dtype=param.dtype, owned=True, overlap=False)
        grad = ShardedParam(_grad_landing.run_tensor_hooks(param, shard.to(param.dtype)), where, name=key)
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
        _grad_landing.gradient_landed(param)


def refuse_uninitialized_parameters(module: nn.Module) -> None:
    """A lazy module's parameter has no shape until its first forward, so it has no rows to split; torch's own
    error would come from deep inside the plan check and not say what to do."""
    from torch.nn.parameter import UninitializedParameter

    for name, param in module.named_parameters():
        if isinstance(param, UninitializedParameter):
            raise ValueError(
                f"shard_module: parameter {name!r} is uninitialized (a lazy module such as nn.LazyLinear has no "
                "shape before its first forward). Fix: run one forward with a sample batch before shard_module, "
                "or give the module its input size.")


# ------------------------------------------------------------------------------------------- every rank alike
def check_same_model_on_every_rank(module: nn.Module, group, settings: dict) -> None:
    """Different models (or sharding settings) on different ranks would make the gathers disagree (a hang or
    garbage): fail in ``shard_module``, on every rank, naming the first difference.  Different weights are
    not an error: every rank takes rank 0's (see [Note: rank 0's weights] in ``_agreement``)."""
    if _comm.world_size(group) == 1:
        return
    named = list(module.named_parameters()) + [(f"buffer {n}", b) for n, b in module.named_buffers()]
    fingerprint = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    plan = (_comm.world_size(group), _comm.group_ranks(group))
    values = [_sample_digest(p) for _, p in named]
    with _comm._div.steps_left_out():  # compared below: a fresh model after a named step divergence starts over
        everyone = _comm.all_gather_object(
            (plan, fingerprint, settings, values, _comm._div.step_record(group)), group,
            label="shard_module's plan check (every rank of the group must call shard_module with the same group)")
    me = _comm.rank(group)
    if any(other[4][:2] != everyone[0][4][:2] for other in everyone):
        _comm._div.take_step_record(group, [other[4] for other in everyone])
        log.warning("shard_module: the ranks' optimizer-step records over this group differed after an earlier "
                    "DivergenceError (an opt.step() or a scheduler step on some ranks only); this model starts "
                    "every rank from rank 0's record. A model trained before that error holds mixed rows.")
    for other_rank, (other_plan, *_) in enumerate(everyone):
        if other_plan != plan:
            raise ValueError(
                f"shard_module on rank {me}: rank {other_rank} shards over a different process group "
                f"(world size {other_plan[0]}, global ranks {other_plan[1]}) than this rank (world size {plan[0]}, "
                f"global ranks {plan[1]}). Every rank must pass the same group to shard_module.")
    for other_rank, (_, other, other_settings, *_) in enumerate(everyone):
        if other != fingerprint:
            raise ValueError(f"shard_module on rank {me}: rank {other_rank} has a different model "
                             f"({_first_difference(fingerprint, other, other_rank)}). Every rank must shard the "
                             "same architecture, with its parameters registered in the same order.")
        differ = {k: (v, other_settings.get(k)) for k, v in settings.items() if other_settings.get(k) != v}
        if differ:
            what = ", ".join(f"{k}={here!r} here, {there!r} on rank {other_rank}" for k, (here, there) in differ.items())
            raise ValueError(f"shard_module on rank {me}: the ranks shard with different settings ({what}); they "
                             "decide which collectives run, so every rank must call shard_module with the same "
                             "arguments.")
    differ = [k for k, digest in enumerate(values)
              if digest and any(other[3][k] and other[3][k] != digest for other in everyone)]
    if differ:
        take_rank0_values([named[k] for k in differ], group)  # see [Note: rank 0's weights] in _agreement
        log.info("shard_module: %d parameters or buffers (first %r) held other values on other ranks (no "
                 "torch.manual_seed, or a seed per rank, before building the model): every rank took rank 0's, as "
                 "DDP does.", len(differ), named[differ[0]][0])


def _first_difference(mine: list, other: list, other_rank: int) -> str:
    extra, missing = sorted(set(mine) - set(other))[:3], sorted(set(other) - set(mine))[:3]
    if extra or missing:
        return f"only here: {extra}; only on rank {other_rank}: {missing}"
    k = next(i for i, (a, b) in enumerate(zip(mine, other)) if a != b)
    return (f"the same parameters in another order: parameter #{k} is {mine[k][0]!r} here and {other[k][0]!r} on "
            f"rank {other_rank}")


# ------------------------------------------------------------------------------------------- at every forward
def check_not_moved(owners: list, gatherer, impls: dict) -> None:
    """``model.to(...)``/``.double()``/``.cuda()`` after sharding swaps each parameter's contents for a converted
    copy that has neither the gradient hook nor a place in the gather schedule (gradients would silently stop
    being averaged), ``load_state_dict(assign=True)`` replaces parameters outright, and a parametrization
    (``weight_norm``) moves them out of ``_parameters``.  One identity check per parameter per forward catches
    them before anything runs."""
    from .tensor import ShardedParam

    for submodule, name, param in owners:
        current = submodule._parameters.get(name)
        if current is param and (not isinstance(param, ShardedParam) or param._gatherer is gatherer):
            if impls.get(id(param), param._cdata) != param._cdata:
                _rehook_after_swap(param, impls)
            continue
        fqn = param._name if isinstance(param, ShardedParam) else name
        if (isinstance(current, torch.Tensor) and current.shape == param.shape and not torch.is_grad_enabled()
                and not isinstance(current, nn.Parameter)):  # functional_call(model, ema_weights) to evaluate:
            continue  # no gradient to average; a swap that stays is named at the next forward with gradients
        if current is None:
            raise RuntimeError(
                f"shardtensor: parameter {fqn!r} was removed from its module after shard_module (a parametrization "
                "such as weight_norm, spectral_norm or register_parametrization moves it, as does del): the "
                "tensors that replace it are not sharded and their gradients are not averaged across ranks. Fix: "
                "apply parametrizations before shard_module; to remove one (remove_weight_norm, "
                "remove_parametrizations, for export), call shardtensor.unshard_module(model) first.")
        if isinstance(current, ShardedParam) and current._gatherer is gatherer \
                and not any(current is other for _, _, other in owners):  # p.detach().requires_grad_()
            raise RuntimeError(
                f"shardtensor: parameter {fqn!r} was replaced after shard_module by a tensor made from the sharded "
                f"parameters ({current._name!r}: p.detach().requires_grad_(), a clone), as torch.func.functional_call"
                "(model, copies, ...) does: their gradients would reach no reduction. Fix: pass the parameters "
                "themselves (dict(model.named_parameters())), or evaluate the copies under torch.no_grad().")
        if isinstance(current, ShardedParam) and current._gatherer is gatherer:  # another of this model's
            raise RuntimeError(
                f"shardtensor: parameter {fqn!r} was replaced after shard_module by the model's own "
                f"{current._name!r} (weights tied after sharding, model.head.weight = model.emb.weight): the two "
                "were sharded apart, and the tie would drop the first's gradient hook and gathers. Fix: tie the "
                "weights before shard_module (shard_module keeps tied parameters tied).")
        if isinstance(current, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(current):
            raise RuntimeError(
                f"shardtensor: parameter {fqn!r} is a torch.func transform's tensor here (grad or vmap over "
                "functional_call's parameters: per-sample gradients, MAML): a transform over the parameters of a "
                "sharded model is not supported, its gradients would reach no reduction. Fix: transforms with "
                "respect to the input work; for ones over the parameters use an unsharded copy (a plain model that "
                "loaded shardtensor.full_state_dict(model)), or torch.autograd.grad per sample.")
        what = f"{type(current).__name__}({tuple(current.shape)}, {current.dtype}, {current.device})" \
            if isinstance(current, torch.Tensor) else repr(current)
        raise RuntimeError(
            f"shardtensor: parameter {fqn!r} was converted or replaced after shard_module (now {what}): "
            "model.to(...)/.double()/.half()/.cuda()/.to_empty(...) (after meta init, shardtensor.materialize("
            "model, device=...) is to_empty for a sharded model), FSDP2's fully_shard, load_state_dict(assign=True) or "
            "torch.func.functional_call with plain tensors on a sharded model drops its gradient hook and gather "
            "schedule, so gradients would "
            "silently stop being averaged across ranks. Fix: move or convert the model before shard_module (or "
            "shard a fresh model and load shardtensor.full_state_dict into it); functional_call takes the sharded "
            "parameters themselves. Where the model's own forward converts a submodule (a router that runs "
            "self.classifier.to(torch.float32) every call), convert that submodule to that dtype before "
            "shard_module.")


def rehook_swapped(owners: list, impls: dict) -> None:
    """Root forward post-hook: a conversion that changed nothing, run inside the forward (a module that does
    ``self.classifier = self.classifier.to(self.dtype)`` in every forward), swapped contents after the pre-hook
    looked; its hooks must be back before the backward reaches it."""
    for submodule, name, param in owners:
        if impls.get(id(param), param._cdata) != param._cdata and submodule._parameters.get(name) is param:
            _rehook_after_swap(param, impls)


def _rehook_after_swap(param, impls: dict) -> None:
    """``model.float()`` / ``.to("cpu")`` that changes nothing still swaps a tensor subclass's contents
    (``nn.Module._apply`` uses ``torch.utils.swap_tensors`` for wrapper subclasses): the parameter keeps its
    identity, shard, dtype and device, but its C++ tensor is new and has none of the gradient hooks, so its
    gradient would land unreduced (a full, per-rank tensor).  Re-setting the hook dicts registers them again,
    the user's hooks with ours."""
    for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(param, attr, None)
        if hooks is not None:
            setattr(param, attr, hooks)
    impls[id(param)] = param._cdata


def check_no_new_parameters(module: nn.Module, known: set) -> None:
    """A trainable plain parameter added after ``shard_module`` (a new head, ``resize_token_embeddings``) is
    neither sharded nor averaged: each rank would train its own copy and the ranks drift apart, silently."""
    from .tensor import ShardedParam

    for submodule in module.modules():
        for param in submodule._parameters.values():
            if param is None or id(param) in known or isinstance(param, ShardedParam) or not param.requires_grad:
                continue
            fqn = next(f"{m}.{n}" if m else n for m, sub in module.named_modules() for n, p in sub._parameters.items()
                       if p is param)
            raise RuntimeError(
                f"shardtensor: parameter {fqn!r} ({tuple(param.shape)}) was added after shard_module: it is not "
                "sharded and its gradient is not averaged across ranks, so each rank would train its own copy. "
                "Fix: build the whole model (new heads, resized embeddings, adapters) before shard_module, or "
                "shardtensor.unshard_module(model), change it, and shard it again; a parameter meant to stay "
                "local can be frozen (requires_grad=False).")


# ------------------------------------------------------------------------------------------- wrappers
class RefuseDDP:
    """Set as the sharded root's ``_ddp_params_and_buffers_to_ignore``, the attribute DistributedDataParallel reads
    (and only it) when it wraps a module.  DDP over a sharded model averaged the ranks' *different* gradient rows
    with each other and trained on wrong numbers without a word (transformers' Trainer and accelerate wrap a model
    in DDP by themselves when launched with several processes); iterating this raises, naming the fix."""

    def __iter__(self):
        raise TypeError(_DDP_REFUSAL)


_DDP_REFUSAL = (
    "DistributedDataParallel over a model sharded by shardtensor.shard_module: shard_module already averages the "
    "gradients across ranks, and DDP would average each rank's gradient rows with other ranks' rows (wrong "
    "numbers). Fix: use the sharded model without DDP (transformers' Trainer and accelerate wrap a model in DDP "
    "when launched with several processes: use a plain training loop), or shardtensor.unshard_module(model) "
    "first to train it under DDP.")


def refuse_inside_ddp() -> None:
    """DDP over a module that *contains* the sharded one never reads the sharded root's attribute: its forward
    does, through the root forward pre-hook (every rank, before any gather)."""
    if DistributedDataParallel._get_active_ddp_module() is not None:
        raise TypeError(_DDP_REFUSAL)
