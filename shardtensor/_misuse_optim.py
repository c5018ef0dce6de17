"""Mistakes seen at ``opt.step()``: a global optimizer step pre-hook and post-hook (registered once, when
shardtensor is imported; they cost a count comparison and a set lookup per step).

- an optimizer built before ``shard_module`` holds the replaced tensors: its ``step()`` would update tensors the
  model no longer uses (refused at its first step, before anything is updated);
- an optimizer state dict loaded from another rank's file (or another world size's): the step would mix other
  rows into this rank's (refused at the first step after the load, naming the state); an unsharded run's state,
  the same on every rank, is cut to each rank's rows there instead (``_full_optim_state``);
- ``opt.step()`` while gradients are deferred by ``gradient_sync(model, False)``: it would apply zero gradients
  and leak the deferred ones into the next step (refused at the step);
- a step taken on some ranks only: counted per group, named at the next gather (see [Note: optimizer steps in
  the record] in ``_comm_divergence``).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

from ._full_optim_state import FullState, agree_on_full_state, is_full_state, own_rows, \
    shaped_for_another_parameter
from ._dtensor_loads import take_dtensor_state
from ._misuse import _DEFERRING
from ._state_to_load_into import drop_if_never_loaded
from ._step_record import note_optimizer_step, settings_digest  # noqa: F401  (note_optimizer_step: re-exported)
from ._torch_state_dict import full_optimizer_state_for_torch_helpers

_FIX_OPTIMIZER = ("Fix: build the optimizer, and any parameter lists its groups take (decay / no-decay groups "
                  "from model.named_parameters()), after shard_module (opt = torch.optim.X(model.parameters(), "
                  "...)).")


_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> parameters already checked


def _refuse_optimizer_built_first(optimizer: torch.optim.Optimizer) -> None:
    """The DDP habit of building the optimizer before ``shard_module`` leaves it holding the full tensors that
    ``shard_module`` replaced (they carry ``_shardtensor_sharded_as``): ``step()`` would update them while the
    model never changes.  Checked at an optimizer's first step (and again when parameter groups are added),
    before anything is updated; later steps cost one sum over the groups.  (Finding such optimizers at
    ``shard_module`` time needs a scan of every live object, ~0.1-1 s per call: too dear for every model.)"""
    if isinstance(optimizer, torch.optim.Adafactor) or type(optimizer).__name__ == "Adafactor":  # (transformers')
        _refuse_factored_moments(optimizer)
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    _warn_of_parameters_outside(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = getattr(p, "_shardtensor_sharded_as", None)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): parameter {name!r} was replaced by shard_module after this "
                    "optimizer (or the parameter list of one of its groups) was built, so the optimizer holds the "
                    f"old full tensor: step() would update it while the model never changes. {_FIX_OPTIMIZER}"
                )
    _refuse_zero_redundancy(optimizer)
    _refuse_flat_vector(optimizer)
    _CHECKED[optimizer] = count


def _warn_of_parameters_outside(optimizer: torch.optim.Optimizer) -> None:
    """A trainable plain parameter beside sharded ones that no ``shard_module`` manages (``shard_module(model.
    backbone)`` only, the head trained too) gets this rank's own gradient: the ranks' copies drift apart.  As
    under FSDP2 that may be meant (the user averages it), so a warning, once per optimizer, not an error."""
    from .tensor import ShardedParam

    sharded = next((p for g in optimizer.param_groups for p in g["params"] if isinstance(p, ShardedParam)), None)
    if sharded is None or sharded.shard_layout.world == 1:
        return
    outside = [p for g in optimizer.param_groups for p in g["params"] if not isinstance(p, ShardedParam)
               and p.requires_grad and not getattr(p, "_shardtensor_replicated", False)
               and getattr(p, "_shardtensor_sharded_as", None) is None]  # (that one: refused below)
    if outside:
        warnings.warn(
            f"{type(optimizer).__name__}: {len(outside)} trainable parameter(s) (first of shape "
            f"{tuple(outside[0].shape)}) are outside every shard_module'd module: their gradients are each rank's "
            "own, never averaged, so the ranks' copies drift apart. Fix: call shard_module on the root module (it "
            "shards or replicates every parameter and averages every gradient), or average them yourself.",
            stacklevel=4)


def _refuse_zero_redundancy(optimizer: torch.optim.Optimizer) -> None:
    """``ZeroRedundancyOptimizer`` (ZeRO-1, kept from a DDP script) steps the parameters one rank owns and then
    broadcasts them, which a sharded parameter cannot take (see ``_dispatch.refusals._user_collective``): refused
    at its first step, before any rank updates anything, where its broadcast would have failed after the owners'
    updates."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from .tensor import ShardedParam

    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, ShardedParam):
                raise TypeError(
                    f"ZeroRedundancyOptimizer.step(): parameter {p._name!r} is sharded by shard_module, which "
                    "already shards what ZeroRedundancyOptimizer shards (optimizer state) and the parameters too. "
                    "Nothing was updated. Fix: use the wrapped optimizer itself, e.g. "
                    "torch.optim.AdamW(model.parameters(), ...): its state is this rank's rows only.")


def _refuse_flat_vector(optimizer: torch.optim.Optimizer) -> None:
    """``LBFGS`` flattens every gradient into one full vector and adds slices of a full update to each parameter:
    a shard takes neither.  It was refused at its first sharded parameter, after it had updated the plain ones
    before it (a 0-d logit scale: a model left half-stepped); now before any update, on every rank."""
    from .tensor import ShardedParam

    if not isinstance(optimizer, torch.optim.LBFGS):
        return
    sharded = next((p for g in optimizer.param_groups for p in g["params"] if isinstance(p, ShardedParam)), None)
    if sharded is not None:
        raise TypeError(
            f"LBFGS.step(): parameter {sharded._name!r} is sharded by shard_module, and LBFGS works on one flat "
            "vector of every parameter and gradient, which no rank holds. Nothing was updated. Fix: a first-order "
            "torch.optim optimizer (AdamW, SGD) on the sharded model, or LBFGS on the unsharded model "
            "(shardtensor.unshard_module(model)).")


def _refuse_factored_moments(optimizer: torch.optim.Optimizer) -> None:
    """Adafactor keeps, per matrix, a row and a column mean of the squared gradient; the column means sum over
    the rows that the ranks split, and its update divides by their mean, neither of which a shard can compute
    alone.  It used to fail deep in its first matrix's update after stepping the vectors before it (a model
    left half-stepped); now it is refused before any update, on every rank (each sees the same parameters)."""
    from .tensor import ShardedParam

    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, ShardedParam) and p.dim() >= 2 and p.grad is not None:
                raise TypeError(
                    f"{type(optimizer).__module__}.Adafactor.step(): parameter {p._name!r} {tuple(p.shape)} is sharded by shard_module, and "
                    "Adafactor's factored second moments (row and column means of a matrix's squared gradient) "
                    "need all of its rows. Nothing was updated. Fix: torch.optim.AdamW (or another torch.optim "
                    "optimizer) on the sharded model, or keep matrices out of shard_module "
                    "(shard_module(model, persist_numel=N) keeps parameters below N elements whole).")


_STATE_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> id of the state dict checked


def _refuse_state_of_another_rank(optimizer: torch.optim.Optimizer) -> None:
    """``opt.load_state_dict(torch.load(f))`` with a file another rank saved (rank 0's, on every rank), one saved
    at another world size, or one of an unsharded run: the state's shards are other rows than this rank's
    parameters (the step would mix them, or fail on one rank only with an unrelated message).  Checked at the
    first step after ``load_state_dict`` (which replaces ``optimizer.state``): one id comparison per step else.
    The verdict is agreed over the parameters' group (one flag all-reduce, only where the state was loaded):
    rank 0's file is rank 0's own rows, so rank 0 alone would step, and the ranks' rows would be steps apart.
    The same exchange tells whether every rank holds an unsharded run's full state, kept then as each rank's rows
    (FSDP2's resume from a full checkpoint)."""
    if _STATE_SEEN.get(optimizer) == id(optimizer.state):
        return
    if optimizer not in _STATE_SEEN:  # the id alone is not enough: the replaced state's id is often reused
        optimizer.register_load_state_dict_post_hook(_forget_checked_state)
        optimizer.register_state_dict_post_hook(full_optimizer_state_for_torch_helpers)
    refusal = take_dtensor_state(optimizer) or None  # (set_optimizer_state_dict with DTensors)
    found, loaded, group, full = _state_of_another_rank(optimizer)
    refusal = refusal or found
    if loaded:  # one exchange of flags: every rank refuses, or every rank's state is its rows, or every rank's full
        try:
            agree_on_full_state(f"{type(optimizer).__name__}.step()", full, group, others_refuse=refusal is not None)
        except RuntimeError:
            if refusal is None:
                raise
            raise RuntimeError(refusal) from None
        _keep_own_rows_of_full_state(optimizer, full)
        _rebind_to_parameter_groups(optimizer)
    _STATE_SEEN[optimizer] = id(optimizer.state)


def _rebind_to_parameter_groups(optimizer: torch.optim.Optimizer) -> None:
    """A state shard unpickled from this rank's own file has lost its process group (a group object does not
    survive a pickle): for a parameter sharded over a subgroup its layout then differs from the parameter's,
    and the step failed half way (``lerp_`` of two layouts).  Its rows are this rank's: it takes the
    parameter's layout back (no copy)."""
    from .tensor import ShardedParam

    for p, state in optimizer.state.items():
        if not isinstance(p, ShardedParam):
            continue
        for key, value in state.items():
            if isinstance(value, ShardedParam) and value._layout != p._layout and not value._views:
                state[key] = ShardedParam.from_local(value._local, p._layout, name=value._name)


def _state_of_another_rank(optimizer: torch.optim.Optimizer) -> tuple:
    """(why this rank's state is not its own rows, or None; whether any sharded parameter has state; their
    group; the full (unsharded) state tensors, each rank's rows to be kept)."""
    from .tensor import ShardedParam

    loaded, group, full = False, None, []
    kept_local_alike = getattr(optimizer, "holds_local_shard_state", False)  # (CPUAdam's state is plain rows)
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            if not isinstance(p, ShardedParam) or p not in optimizer.state:
                continue
            if not loaded:  # the first's group: the same on every rank, wherever each rank's check stops
                loaded, group = True, getattr(p._layout, "group", None)
            here = (p._layout.rank, p._layout.world)
            for key, value in optimizer.state[p].items():
                if is_full_state(p, value, kept_local_alike):
                    full.append(FullState(p._name, p, key, value))
                elif shaped_for_another_parameter(p, value):
                    return (f"{type(optimizer).__name__}.step(): the optimizer state {key!r} of {p._name!r} has shape "
                            f"{tuple(value.shape)}, but the parameter is {tuple(p.shape)}: a state dict of another "
                            "model (or of another parameter order). Nothing was updated on any rank. Fix: load the "
                            "optimizer state saved with this model.", loaded, group, full)
                if not isinstance(value, ShardedParam) or value.dim() == 0:
                    continue
                saved = (getattr(value._layout, "rank", None), getattr(value._layout, "world", None))
                if saved == here and value._layout.shape == p._layout.shape:
                    continue
                return (f"{type(optimizer).__name__}.step(): the optimizer state {key!r} of {p._name!r} is rank "
                        f"{saved[0]}'s rows of a {saved[1]}-rank run, but this is rank {here[0]} of {here[1]}: a "
                        "state dict loaded from another rank's or another run's file. Nothing was updated on any "
                        "rank. Fix: torch.save(opt.state_dict()) and load it back on each rank with its own file at "
                        "the same world size, or shardtensor.save_checkpoint(dir, model, opt) / load_checkpoint "
                        "(any world size).", loaded, group, full)
    return None, loaded, group, full


def _keep_own_rows_of_full_state(optimizer: torch.optim.Optimizer, full: list) -> None:
    """Every rank holds the same full state (agreed): each keeps its rows, as its own run's state would be."""
    from .tensor import ShardedParam

    for item in full:
        rows = own_rows(item.param, item.value)
        optimizer.state[item.param][item.key] = (
            rows if getattr(optimizer, "holds_local_shard_state", False)
            else ShardedParam.from_local(rows, item.param._layout, name=item.param._name))


def _forget_checked_state(optimizer: torch.optim.Optimizer) -> None:
    """Load post-hook: ``load_state_dict`` put new state in, to be checked at the next step.  (The new state
    dict often gets the id of the one it replaced, freed a moment before: a hang in the test suite, where one
    rank skipped the check and gathered inside Adam while the other refused the step.)"""
    _STATE_SEEN[optimizer] = None


@torch._disable_dynamo  # (imports Dynamo at its first call, as torch.optim's own methods do)
def _step_pre_hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: refuse a step while gradients of this optimizer's parameters are deferred
    (``opt.step()`` inside ``gradient_sync(model, False)``): the parameters' ``.grad`` are zero shards then, the
    step would apply nothing useful, and the deferred gradients would leak into the next step.  Also refuses an
    optimizer built before ``shard_module``.  Never traced: see [Note: a compiled optimizer step]."""
    _check_step(optimizer)
    from ._dispatch import traced

    traced.optimizer_step_begins()


def _check_step(optimizer: torch.optim.Optimizer) -> None:
    drop_if_never_loaded(optimizer)
    _refuse_optimizer_built_first(optimizer)
    _check_models_before_step(optimizer)
    _refuse_state_of_another_rank(optimizer)
    if optimizer not in _MAKING_STATE:
        _refuse_deferred_gradients(optimizer)


_MAKING_STATE: "weakref.WeakSet" = weakref.WeakSet()


@contextlib.contextmanager
def making_state(optimizer: torch.optim.Optimizer):
    """torch's ``get_optimizer_state_dict`` makes a fresh optimizer's state with a step at lr 0 on zero gradients.
    That is not the user's step: a save between ``no_sync`` micro-batches was refused with "opt.step(): the
    gradient is still deferred", naming a step the user never took."""
    _MAKING_STATE.add(optimizer)
    try:
        yield
    finally:
        _MAKING_STATE.discard(optimizer)


def check_optimizer_step(optimizer: object, params: list[torch.Tensor]) -> None:
    """The checks the global step pre-hook gives every ``torch.optim`` step, for an optimizer that steps other
    tensors than the model's parameters (``shardtensor.optim.Muon`` steps each owner's plain local tensors, which
    those checks never saw: a step after ``unshard_module`` moved nothing, one inside ``gradient_sync(model,
    False)`` stepped zeros, one on a rank's own ``.grad`` stepped it unaveraged, all silently).  Call it at the
    start of ``step()``, on every rank, with the model's parameters it steps: it raises before any update."""
    groups = [{"params": params}]
    _check_models_before_step(optimizer, groups)
    _refuse_deferred_gradients(optimizer, groups)


def _refuse_deferred_gradients(optimizer: object, groups: "list | None" = None) -> None:
    busy = [gs for gs in list(_DEFERRING) if gs._deferred]
    if not busy:
        return
    held = {id(p) for group in (groups or optimizer.param_groups) for p in group["params"]}
    for gs in busy:
        owners = gs.__dict__.get("_deferred_owner", {})
        for key in gs._deferred:
            owner = owners.get(key)
            if owner is None or id(owner[0]) in held:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): the gradient of {key!r} is still deferred "
                    "by shardtensor.gradient_sync(model, False) (its .grad holds zeros until a backward with sync on "
                    "reduces it). Fix: run the last micro-batch's backward outside gradient_sync(model, False), "
                    "then call opt.step()."
                )


_SHARDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> (count, its sharded params)


def _sharded_of(optimizer: object, groups: "list | None" = None) -> tuple:
    """(count, its sharded parameters, the indices of groups holding them, their Gatherers), listed once per
    parameter count.  ``groups``: the parameter groups to read, where they are not ``optimizer.param_groups``."""
    from .tensor import ShardedParam

    groups = optimizer.param_groups if groups is None else groups
    count = sum(len(group["params"]) for group in groups)
    cached = _SHARDED.get(optimizer)
    if cached is None or cached[0] != count:
        sharded = [p for group in groups for p in group["params"] if isinstance(p, ShardedParam)]
        cached = _SHARDED[optimizer] = (count, sharded,
                                        [i for i, group in enumerate(groups)
                                         if any(isinstance(p, ShardedParam) for p in group["params"])],
                                        list({id(p._gatherer): p._gatherer for p in sharded
                                              if p._gatherer is not None}.values()))
    return cached


_UNSHARDED: "weakref.WeakSet" = weakref.WeakSet()  # Gatherers of models unshard_module gave back


def note_unsharded(gatherer) -> None:
    """``unshard_module`` gave the model back: an optimizer still stepping its old sharded parameters is named."""
    _UNSHARDED.add(gatherer)


_CHECKS_AT_STEP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Gatherer -> checks_run at a step


def _check_models_before_step(optimizer: object, groups: "list | None" = None) -> None:
    """A compiled forward runs neither the root's hook nor an eager gather, so the root's checks (a parameter
    added, converted or unfrozen after ``shard_module``, ...) would never run: they run here instead, before any
    update, for a model whose checks have not run since the last step.  And a sharded parameter whose ``.grad``
    is a plain tensor (its hook was not in place when backward ran) is named here, before any update, not in
    the middle of the optimizer's loop.  A comparison per model and a type test per parameter else."""
    _, sharded, _, gatherers = _sharded_of(optimizer, groups)
    for gatherer in gatherers:
        if gatherer in _UNSHARDED:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): this optimizer holds the sharded parameters of a model that "
                "shardtensor.unshard_module turned back into a plain one; the model's parameters are new tensors "
                "now, and this step would update none of them. Nothing was updated. Fix: build a new optimizer over "
                "model.parameters() after unshard_module (or shard_module again and keep this optimizer's model).")
        if gatherer.step_checks is not None and _CHECKS_AT_STEP.get(gatherer, 0) == gatherer.checks_run:
            gatherer.step_checks()
        _CHECKS_AT_STEP[gatherer] = gatherer.checks_run
    unaveraged = next((p for p in sharded if type(p.grad) is torch.Tensor), None)
    if unaveraged is None:
        return
    for gatherer in gatherers:  # hooks an unfrozen parameter for the next backward (or names a conversion)
        if gatherer.step_checks is not None:
            gatherer.step_checks()
    raise RuntimeError(
        f"{type(optimizer).__name__}.step(): the gradient of {unaveraged._name!r} is this rank's own full gradient, "
        "never averaged across ranks: its gradient hook was not in place when backward ran (a parameter frozen at "
        "shard_module and unfrozen later, trained under torch.compile or through children only: its hook is "
        "attached now; or a model converted after shard_module, e.g. model.float()), or a full tensor was "
        "assigned to .grad (p.grad = g with g from torch.autograd.grad: each rank's own, as under DDP). Nothing "
        "was updated. Fix: opt.zero_grad() and run this step's forward and backward again (the gradient is averaged "
        "from now on), or unfreeze and convert before shard_module; instead of assigning .grad, call backward (the "
        "hooks average the gradient and keep this rank's rows).")


@torch._disable_dynamo
def _step_post_hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global optimizer step post-hook: count the step (``note_optimizer_step``) over the optimizer's sharded
    parameters."""
    from ._dispatch import traced

    _, sharded, groups, _ = _sharded_of(optimizer)
    traced.optimizer_step_ends([p for p in sharded if p.grad is not None])
    note_optimizer_step(sharded, settings_digest(optimizer, groups))


from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402

register_optimizer_step_pre_hook(_step_pre_hook)
register_optimizer_step_post_hook(_step_post_hook)
