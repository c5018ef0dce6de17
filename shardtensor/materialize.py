"""Meta-device init: build a model with no memory, shard it, then allocate and initialise only the shards.

    with torch.device("meta"):
        model = Big()                      # no storage anywhere
    shardtensor.shard_module(model)        # ShardedParams over meta shards
    shardtensor.materialize(model)         # each rank allocates its rows and runs reset_parameters()

[Note: same values as unsharded init]
``nn.init`` draws in place (``uniform_``, ``normal_``...).  On a ShardedParam the op table draws the *full*
tensor from the same generator and keeps this rank's rows (``_dispatch/local.py``, ``_random_init``), so with the same
seed every rank ends with its rows of exactly the tensor an unsharded init draws, and the generator advances by
the same amount.  The price is one full parameter alive during its own init: peak memory is the shards plus the
largest single parameter, never the whole model.

The draws must also come in the unsharded order.  A module's ``__init__`` builds its children (each drawing its
own parameters) and *then* initialises itself: ``nn.MultiheadAttention`` builds ``out_proj`` and then runs
``_reset_parameters()`` on ``in_proj_weight``; ``nn.Transformer`` re-draws every matrix after its layers are
built.  So modules are initialised children first (post-order), each by ``reset_parameters()`` or, where it has
none, ``_reset_parameters()``.  A parameter that no such method owns (drawn inline in some ``__init__``) cannot
be re-created: ``materialize`` refuses it by name and asks for an ``init_fn``.  A module that draws in another
order than this (or tied weights, which keep the last module's init) needs an ``init_fn`` too.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional, Union

import torch
from torch import nn

from . import _comm
from .api import _sharding_state
from .tensor import ShardedParam

log = logging.getLogger("shardtensor")


@torch.no_grad()
def materialize(
    module: nn.Module,
    init_fn: Optional[Callable[[nn.Module], None]] = None,
    *,
    device: Union[torch.device, str, None] = None,
) -> nn.Module:
    """Allocate the meta-device shards (and meta buffers / unsharded parameters) of a sharded module, then init.

    Args:
        module: the root module returned by ``shard_module`` (built under ``torch.device("meta")``).
        init_fn: called once as ``init_fn(module)`` after allocation (e.g. ``lambda m: m.apply(my_init)``).
            (Default: ``reset_parameters()`` (or ``_reset_parameters()``) of every submodule that has one,
            children before parents; see [Note: same values as unsharded init].)
        device: where the shards live (Default: CPU, or the current CUDA device when CUDA is available).
    Returns:
        ``module`` itself; memory allocated on this rank is its shards plus, transiently, one full parameter.
    """
    state = _sharding_state(module)
    computed_buffers = _uncovered_meta_buffers(module)  # no reset method recomputes these: an init_fn must
    if init_fn is None:
        _refuse_what_no_reset_initialises(module, computed_buffers)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    real = _WriteWatch([(n, t) for n, t in _named_tensors(module) if not t.is_meta])  # loaded weights, maybe
    had_meta = {id(m) for m in module.modules() if any(t.is_meta for _, t in _named_tensors(m))}
    done: set[int] = set()
    allocated = []  # buffers allocated here: (fqn, module, name)
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        for name, param in list(submodule._parameters.items()):
            if param is None or not param.is_meta or id(param) in done:
                continue
            done.add(id(param))
            _allocate_in_place(param, f"{module_name}.{name}" if module_name else name, state, device)
        for name, buffer in list(submodule._buffers.items()):
            if buffer is not None and buffer.is_meta:
                submodule._buffers[name] = torch.zeros_like(buffer, device=device)
                allocated.append((f"{module_name}.{name}" if module_name else name, submodule, name))
    untouched = _WriteWatch([(fqn, m._buffers[name]) for fqn, m, name in allocated])

    own_generator = _draw_from_rank0_generator(device, state.group)
    try:
        if init_fn is not None:
            init_fn(module)
        else:
            for submodule in _post_order(module):
                reset = _reset_method(submodule)
                if reset is not None and id(submodule) in had_meta:  # a module with no meta tensor keeps its values
                    reset()
    finally:
        if own_generator is not None:
            _set_generator_state(device, own_generator)
    _check_after_init(module, init_fn, untouched, real)
    return module


def _named_tensors(module: nn.Module):
    return [*module.named_parameters(remove_duplicate=True), *module.named_buffers(remove_duplicate=True)]


class _WriteWatch:
    """Which of some tensors were written (in place, by version counter) or replaced, since it was made."""

    def __init__(self, named: list):
        self.entries = [(fqn, t, _version(t)) for fqn, t in named]

    def untouched(self, module: nn.Module) -> list[str]:
        return [fqn for fqn, t, v in self.entries if _current(module, fqn) is t and _version(t) == v]

    def written(self, module: nn.Module) -> list[str]:
        return [fqn for fqn, t, v in self.entries if _current(module, fqn) is not t or _version(t) != v]


def _version(t: torch.Tensor) -> int:
    return t._local._version if isinstance(t, ShardedParam) else t._version


def _current(module: nn.Module, fqn: str) -> Optional[torch.Tensor]:
    owner, _, name = fqn.rpartition(".")
    sub = module.get_submodule(owner)
    return sub._parameters.get(name, sub._buffers.get(name))


def _check_after_init(module: nn.Module, init_fn, untouched: _WriteWatch, real: _WriteWatch) -> None:
    """A meta buffer nothing wrote is still the zeros allocated for it (a causal mask an ``__init__`` computed on
    the meta device, under a module whose ``reset_parameters()`` does not recompute it: NaN logits); a tensor
    that was not on the meta device and was re-drawn lost what it held (weights loaded before ``materialize``)."""
    left = untouched.untouched(module)
    if left and init_fn is None:
        raise ValueError(
            f"materialize: meta buffer {left[0]!r} (of {len(left)} such: {', '.join(map(repr, left[:4]))}) was "
            "not set by any reset_parameters() or _reset_parameters(): its values were computed in an __init__ that "
            "ran on the meta device (a causal mask, position ids, rotary frequencies), so it is all zeros. Fix: pass "
            "materialize(model, init_fn) with an init_fn that sets it (for a Hugging Face model: lambda m: "
            "m.apply(m._init_weights)), or build that module off the meta device.")
    if left:
        warnings.warn(
            f"materialize: buffer {left[0]!r} (of {len(left)} such: {', '.join(map(repr, left[:4]))}) was built "
            "on the meta device by an __init__ and is still all zeros after init_fn. If its __init__ computed it "
            "(position ids, rotary frequencies, a causal mask), set it in init_fn; the model would use zeros.",
            stacklevel=3)
    redrawn = real.written(module)
    if redrawn:
        warnings.warn(
            f"materialize: {redrawn[0]!r} (of {len(redrawn)} such: {', '.join(map(repr, redrawn[:4]))}) was not on "
            "the meta device and was re-initialised by " + ("init_fn" if init_fn else "a parent module's reset") +
            ": if it held loaded weights they are gone. Fix: load them after materialize, or keep them out of "
            "init_fn (materialize allocates and initialises only what was built on the meta device).", stacklevel=3)


def _generator_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _draw_from_rank0_generator(device: torch.device, group) -> Optional[torch.Tensor]:
    """Each rank keeps its rows of the tensor its own generator draws (see [Note: same values as unsharded init]),
    so generators in different states would give a patchwork of the ranks' inits, and parameters kept whole on
    every rank would never agree.  They differ unless the script seeds alike: torch seeds each new process at
    random.  Then every rank draws from rank 0's state (rank 0's init, as DDP takes rank 0's weights), and gets
    its own state back afterwards (returned here; None when the states agree and nothing is changed)."""
    if _comm.world_size(group) == 1:
        return None
    own = _generator_state(device)
    everyone = _comm.all_gather_object(own.cpu().numpy().tobytes(), group,
                                       label="materialize: the ranks' random generators")
    if all(state == everyone[0] for state in everyone):
        return None
    _set_generator_state(device, torch.frombuffer(bytearray(everyone[0]), dtype=torch.uint8))
    log.info("materialize: the ranks' random generators differed (no torch.manual_seed, or a seed per rank): "
             "every rank drew from rank 0's, then got its own back.")
    return own


def _reset_method(module: nn.Module) -> Optional[Callable[[], None]]:
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return reset
    return None


def _post_order(module: nn.Module, seen: Optional[set] = None):
    """Children before their parent, siblings in registration (construction) order; shared modules once."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        yield from _post_order(child, seen)
    yield module


def _refuse_what_no_reset_initialises(module: nn.Module, computed_buffers: list[str]) -> None:
    """A meta parameter whose module and ancestors all lack a reset method would stay all zeros (its values
    were drawn inline in an ``__init__`` that never ran for real): refuse before anything is allocated."""
    covered: set[int] = set()
    orphans: dict[int, str] = {}

    def walk(mod: nn.Module, prefix: str, inherited: bool) -> None:
        has = inherited or _reset_method(mod) is not None
        for name, param in mod._parameters.items():
            if param is not None and param.is_meta:
                (covered.add(id(param)) if has else orphans.setdefault(id(param), prefix + name))
        for name, child in mod._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.", has)

    walk(module, "", False)
    missing = [name for key, name in orphans.items() if key not in covered]
    if not missing and (unset := computed_buffers):
        raise ValueError(
            f"materialize: meta buffer {unset[0]!r} (of {len(unset)} such: {', '.join(map(repr, unset[:4]))}) belongs "
            "to modules without reset_parameters() or _reset_parameters(): its values were computed in an __init__ "
            "that ran on the meta device (position ids, rotary frequencies), so it would stay all zeros. Fix: pass "
            "materialize(model, init_fn) with an init_fn that sets it (for a Hugging Face model, the model's own "
            "init: lambda m: m.apply(m._init_weights), if it sets buffers), or build that module off the meta device.")
    if missing:
        raise ValueError(
            f"materialize: meta parameter {missing[0]!r} (of {len(missing)} such) belongs to modules without "
            "reset_parameters() or _reset_parameters(), so nothing can draw its initial values (they came from code "
            "in an __init__ that ran on the meta device) and it would stay all zeros. Fix: pass "
            "materialize(model, init_fn) with an init_fn that initialises it (e.g. lambda m: nn.init.normal_(m.pos); "
            "for a Hugging Face model, its own init: lambda m: m.apply(m._init_weights))."
        )


def _uncovered_meta_buffers(module: nn.Module, prefix: str = "", inherited: bool = False) -> list[str]:
    """Meta buffers of modules that no reset method (theirs or an ancestor's) covers: values an ``__init__``
    computed on the meta device, which nothing in ``materialize`` can recompute."""
    has = inherited or _reset_method(module) is not None
    found = [] if has else [prefix + n for n, b in module._buffers.items() if b is not None and b.is_meta]
    for name, child in module._modules.items():
        if child is not None:
            found += _uncovered_meta_buffers(child, f"{prefix}{name}.", has)
    return found


def _allocate_in_place(param: nn.Parameter, fqn: str, state, device: torch.device) -> None:
    """Give one meta parameter zero-filled storage on ``device``, keeping the Python object.

    ``torch.utils.swap_tensors`` keeps the parameter's identity (the module, tied modules, the gather schedule
    and shard_module's check that parameters were not replaced all hold this object); the gradient hook lives
    on the swapped-out tensor, so it is registered again here.
    """
    if isinstance(param, ShardedParam):
        meta_local = param.to_local()
        local = torch.zeros(meta_local.shape, dtype=param.dtype, device=device)
        real = nn.Parameter(ShardedParam(local, param.shard_layout, gatherer=state.gatherer, name=fqn), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, real)
        param._backward_hooks = None  # swap_tensors leaves the Python hook dict behind, unwired: start afresh
        param._gatherer, param._name = state.gatherer, fqn
        getattr(state.gatherer, "_index", {}).pop(id(meta_local), None)  # the meta shard is gone: no stale id
        state.gatherer.register(param)
        state.grad_sync.attach(param, state.hook_handles, key=fqn)
        return
    # 0-d, complex or non-floating: replicated, allocated whole
    real = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, real)
    param._backward_hooks = None
    if (param.is_floating_point() or param.is_complex()) and _comm.world_size(state.group) > 1:
        state.grad_sync.attach(param, state.hook_handles, group=state.group, name=fqn)
