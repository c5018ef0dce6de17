"""The one-liner and its companions: ``shard_module``, ``full_state_dict``, ``load_full_state_dict``."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from . import _agreement, _comm, _misuse, _misuse_optim, _torch_state_dict  # noqa: F401  (_misuse_optim: step hooks)
from . import _comm_mesh, _traced_grads
from ._layout import ShardLayout
from ._sync_switch import attach_habits
from ._traced import record_param_dtype
from .gather import Gatherer, GatherMode
from .reduce import ExactReducer, GradientReducer, GradSync
from .layerwise import OwnerReducer, owner_layouts
from .policy import GatherPolicy, MixedPrecisionPolicy, precision_policy
from .tensor import ShardedParam
from ._units import UnitPolicy, attach_units


@dataclass
class ShardingState:
    """What ``shard_module`` attached to the root module (``module._shardtensor``)."""

    gatherer: Gatherer
    grad_sync: GradSync
    group: object
    params: dict  # fully qualified name -> ShardedParam (first name of tied parameters)
    hook_handles: list

    def __deepcopy__(self, memo):
        # Reached by copy.deepcopy(model): the gradient hooks live on the original parameters and the forward
        # hook on the original gatherer, so a copy would train with unaveraged gradients.  Refuse clearly.
        raise TypeError(_misuse.DEEPCOPY_REFUSAL)


def _is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, ShardedParam) for p in module.parameters())


def _outside_inference_mode(fn):
    """``shard_module`` inside ``torch.inference_mode()`` (an eval script) made the shards inference tensors, and
    the first gather failed on their version counter, naming nothing: they are made as normal tensors."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
            return fn(*args, **kwargs)
    return run


@_outside_inference_mode
def shard_module(
    module: nn.Module,
    *,
    group=None,
    gather: "str | GatherPolicy" = "overlapped",
    prefetch_bytes: Optional[int] = None,
    min_free_bytes: int = 1 << 30,
    reducer: Optional[GradientReducer] = None,
    placement: str = "dim0",
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    persist_numel: int = 0,
    offload=None,
    mixed_precision: Optional[MixedPrecisionPolicy] = None,
    units: UnitPolicy = None,
) -> nn.Module:
    """Replace every floating parameter of ``module`` (dim >= 1) by a ``ShardedParam``, in place.

    Each rank keeps ceil(rows / world) rows of dim 0.  Full tensors are gathered by the op that needs them and
    freed after it (``gather="sequential"``), or prefetched in the recorded order within ``prefetch_bytes``
    (``"overlapped"``), or overlapped while free memory stays above ``min_free_bytes`` (``"auto"``).  Gradients
    are reduced to this rank's shard of the mean by ``reducer`` (default: exact reduce-scatter).

    Buffers and non-floating parameters stay as they are (replicated); 0-d floating parameters stay replicated
    and their gradients are averaged.  Tied parameters stay tied.  Every rank must call this with the same
    model: the parameter names and shapes are checked across ranks here, not by a hang later.

    Args:
        module: the model; its parameters must hold the same values on every rank (same seed).
        group: process group to shard over (Default: the default group; a single process needs none).
        gather: ``"sequential"``, ``"overlapped"`` or ``"auto"``, or a ``GatherPolicy`` holding the mode,
            ``prefetch_bytes``, ``min_free_bytes`` and ``persist_numel`` (then leave those keywords out)
            (Default: ``"overlapped"``).
        prefetch_bytes: prefetch budget of overlapped mode, also the bound on gradient reduce-scatters in flight
            (Default: twice the 90th percentile of the parameters' gathered sizes).
        min_free_bytes: auto mode's memory threshold (Default: 1 GiB).
        reducer: gradient reducer (Default: ``ExactReducer(reduce_dtype)``).
        param_dtype: mixed precision: shards stay in their dtype (the fp32 master copy), gathers cast to
            ``param_dtype`` before the collective (half the bytes for bf16) and compute runs in it; floating
            inputs of the root module are cast to it (Default: None, no cast).
        reduce_dtype: dtype of the gradient reduce-scatter (Default: None, the gradient's dtype).
        persist_numel: parameters with fewer elements stay whole on every rank (DeepSpeed's
            ``stage3_param_persistence_threshold``): biases and norm weights cost two gathers per step each for
            a few bytes of memory saved; replicated, they need none, and their gradients are averaged in one
            flat all-reduce at the end of backward (Default: 0, shard everything).
        placement: ``"dim0"`` (each rank keeps ceil(rows / world) rows of every parameter) or ``"layerwise"``
            (each parameter is owned whole by one rank, balanced by bytes; gathers broadcast from the owner,
            gradients reduce to it; see ``shardtensor.layerwise``) (Default: ``"dim0"``).
        offload: ``shardtensor.offload.CPUOffload(...)``: shards in pinned host memory, copied to the GPU before
            their gathers (CUDA only; on a CPU-only machine it raises instead of copying host to host).
            Optimizer state goes to NVMe through ``shardtensor.offload.NVMeCPUAdam`` instead. (Default: None)
        mixed_precision: a ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` instead of the two keywords.
        units: gather units (``shardtensor._units``): module classes or a callable ``module -> bool`` whose
            (outermost) modules gather all their parameters at their forward and backward and reduce their
            gradients together, so ranks whose data calls different members (an MoE expert loop) still issue
            the same collectives; ``False``: none (Default: any module with an expert list or a class named
            *Experts* with its own parameters; in overlapped and auto mode also each member of the outermost
            ModuleList/Sequential, one collective per block).
    Returns:
        ``module`` itself.
    """
    if hasattr(module, "_shardtensor"):
        raise ValueError(
            f"shard_module: {type(module).__name__} is already sharded (it holds ShardedParams). "
            "Shard each model once; to re-shard, call shardtensor.unshard_module(model) first."
        )
    group = _comm_mesh.as_sharding_group(group)
    _refuse_parameters_sharded_elsewhere(module)
    _misuse.refuse_uninitialized_parameters(module)
    _refuse_sparse_embeddings(module)
    _misuse.refuse_before_sharding(module)  # e.g. parameters that are views of other parameters
    _misuse.refuse_shared_reducer(reducer, module)
    policy = _gather_policy(gather, prefetch_bytes, min_free_bytes, persist_numel)
    precision = precision_policy(mixed_precision, param_dtype, reduce_dtype)
    param_dtype, persist_numel = precision.param_dtype, policy.persist_numel
    _misuse.refuse_persisted_with_param_dtype(module, persist_numel, param_dtype)
    gatherer = Gatherer(policy.mode, prefetch_bytes=policy.prefetch_bytes, min_free_bytes=policy.min_free_bytes,
                        param_dtype=param_dtype)
    reducer = reducer if reducer is not None else ExactReducer(precision.reduce_dtype)
    # Layer-wise gradients reduce to their owner: that placement's reducer (owner_layouts refuses the others).
    strategy = OwnerReducer(reducer.reduce_dtype) if placement == "layerwise" and isinstance(reducer, ExactReducer) \
        else None
    grad_sync = GradSync(reducer, strategy=strategy)
    grad_sync.pending_budget = gatherer.reduce_overlap_bytes
    _refuse_dtensor_parameters(module)
    _misuse.check_same_model_on_every_rank(module, group, settings={
        "gather": policy.mode.value, "prefetch_bytes": policy.prefetch_bytes, "persist_numel": persist_numel,
        "param_dtype": str(param_dtype), "reduce_dtype": str(precision.reduce_dtype), "placement": placement,
        "reducer": _settings_of(reducer), "offload": type(offload).__name__})
    if placement not in ("dim0", "layerwise"):
        raise ValueError(f"shard_module: placement={placement!r}; expected 'dim0' or 'layerwise'")
    layouts: dict = {}
    if placement == "layerwise":
        layouts = owner_layouts(module, group, reducer)

    replaced: dict[int, nn.Parameter] = {}
    names: dict[str, ShardedParam] = {}
    handles = []
    owners: list = []  # (module, attribute, parameter), checked at every root forward
    tied_reads: list = []  # (module, attribute, parameter) of a second name of a tied parameter
    visited: set = set()  # a module placed twice (ModuleList([block, block])) holds its parameters once
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        for name, param in list(submodule._parameters.items()):
            if param is None or (id(submodule), name) in visited:
                continue
            visited.add((id(submodule), name))
            fqn = f"{module_name}.{name}" if module_name else name
            if id(param) in replaced:  # tied: the same Parameter object stays one ShardedParam
                submodule._parameters[name] = replaced[id(param)]
                tied_reads.append((submodule, name, replaced[id(param)]))
                continue
            new = _shard_parameter(param, fqn, group, gatherer, grad_sync, handles, layouts.get(id(param)),
                                   persist_numel)
            replaced[id(param)] = new
            submodule._parameters[name] = new
            if isinstance(new, ShardedParam):
                names[fqn] = new
                param._shardtensor_sharded_as = fqn  # so a second model sharing `param` is refused
            owners.append((submodule, name, new))

    reads: dict[int, tuple] = {}  # see [Note: a gradient reduced inside the compiled backward]
    for submodule, name, param in owners + tied_reads:  # (a tied head's read too: its gradient reduced, not gathered)
        if isinstance(param, ShardedParam):
            reads.setdefault(id(submodule), (submodule, []))[1].append(name)
    for submodule, sharded in reads.values():
        _traced_grads.read_through_boundaries(submodule, sharded)

    step_begin = _step_begin_hook(module, gatherer, precision, owners, grad_sync)
    handles.append(module.register_forward_pre_hook(_misuse.PickleRefusingHook(step_begin), with_kwargs=True))
    handles.append(module.register_forward_hook(_misuse.PickleRefusingHook(step_begin.after_forward)))
    _hook_loads(module, names, handles)
    attach_units(module, units, gatherer, grad_sync, handles)  # after the step hook: a root unit gathers second
    module._shardtensor = ShardingState(gatherer, grad_sync, group, names, handles)
    attach_habits(module, grad_sync)  # module.no_sync() (DDP) and set_requires_gradient_sync (FSDP2)
    module._ddp_params_and_buffers_to_ignore = _misuse.RefuseDDP()
    if offload is not None:
        if not hasattr(offload, "attach"):
            raise TypeError(
                f"shard_module: offload={type(offload).__name__} is not a parameter offload; use "
                "shardtensor.offload.CPUOffload(...) (NVMeOffload homes optimizer state: pass it to NVMeCPUAdam)"
            )
        offload.attach(module)
    return module


def _gather_policy(gather, prefetch_bytes, min_free_bytes, persist_numel) -> GatherPolicy:
    if isinstance(gather, GatherPolicy):
        if (prefetch_bytes, min_free_bytes, persist_numel) != (None, 1 << 30, 0):
            raise ValueError("shard_module: gather=GatherPolicy(...) already holds prefetch_bytes, min_free_bytes and "
                             "persist_numel; pass them in the policy, not as keywords too")
        return gather
    try:
        return GatherPolicy(gather, prefetch_bytes, min_free_bytes, persist_numel)
    except ValueError:
        raise ValueError(f"shard_module: gather={gather!r}; expected one of {[m.value for m in GatherMode]}") from None


def _settings_of(obj) -> str:
    """A plug-in's settings as its ``repr`` says them (``CompressedReducer(bits=4, group_size=16, ...)``), else
    its type: with the type alone, ranks with different group sizes were accepted, and where their wire rows
    had one byte length each decoded the others' bytes with its own layout (wrong gradients, no error)."""
    return repr(obj) if type(obj).__repr__ is not object.__repr__ else type(obj).__name__


def _step_begin_hook(root: nn.Module, gatherer: Gatherer, precision: MixedPrecisionPolicy, owners: list = (),
                     grad_sync: Optional[GradSync] = None):
    """Root forward pre-hook: a new gather sequence starts; under mixed precision, floating inputs are cast to
    ``param_dtype`` so they meet the gathered (cast) weights in one dtype (FSDP2's ``cast_forward_inputs``), and
    its forward hook casts floating outputs to ``output_dtype`` (both read off FSDP2's policy too, which was
    taken by its other two fields and these two ignored).
    Its checks also run at a step's first gather where the root's forward is never called (children called
    directly, a container root): ``Gatherer.step_checks``."""

    param_dtype = precision.param_dtype if getattr(precision, "cast_forward_inputs", True) else None
    output_dtype = getattr(precision, "output_dtype", None)

    def cast(x, dtype=param_dtype):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    check_materialized = _misuse.MaterializedCheck()
    known = {id(param) for _, _, param in owners}  # the parameters shard_module placed
    impls = {id(param): param._cdata for _, _, param in owners}  # their C++ tensors, which hold the hooks

    def checks() -> None:
        gatherer.checks_run += 1  # (the optimizer step runs them where nothing did since the last step)
        _misuse.check_not_moved(owners, gatherer, impls)
        _misuse.refuse_inside_ddp()
        _misuse.check_no_new_parameters(root, known)
        check_materialized(root)  # a meta-device model must go through materialize() first
        if grad_sync is not None:
            grad_sync.finish_pending()  # a backward that raised never ran its end-of-backward callbacks
            grad_sync.attach_unfrozen()  # parameters frozen at shard_module, trainable now

    gatherer.step_checks = _misuse.PickleRefusingHook(checks)  # pickling the model reaches it: named refusal

    def after_forward(module, args, output):  # a no-op .to() inside forward (transformers' Switch router)
        if not torch.compiler.is_compiling():
            _misuse.rehook_swapped(owners, impls)
        if output_dtype is not None:
            return tree_map_only(torch.Tensor, functools.partial(cast, dtype=output_dtype), output)
        return None

    def hook(module, args, kwargs):
        if not torch.compiler.is_compiling():  # a traced forward has no eager schedule (see _traced.py)
            checks()
            gatherer.step_begin()
        else:  # traced once, keeping no state (a guard on it would recompile); the compiler's error named no fix
            _misuse.refuse_meta_tensors(root)
        if param_dtype is None:
            return None
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    hook.after_forward = after_forward
    return hook


def _shard_parameter(param: nn.Parameter, fqn: str, group, gatherer: Gatherer, grad_sync: GradSync, handles: list,
                     layout: Optional[ShardLayout] = None, persist_numel: int = 0):
    if not param.is_floating_point() and not param.is_complex():
        return param
    if param.is_complex() or param.dim() == 0 or param.numel() < persist_numel:  # complex: replicated, averaged
        if _comm.world_size(group) > 1:
            grad_sync.attach(param, handles, group=group, name=fqn)
        return param
    if layout is None:
        layout = ShardLayout.for_shape(param.shape, group)
    with torch.no_grad():
        if param.is_meta:
            local = torch.empty(layout.local_shape(), dtype=param.dtype, device="meta")
        else:
            local = layout.shard_of(param.detach())
    sharded = ShardedParam(local, layout, gatherer=gatherer, name=fqn)
    record_param_dtype(layout, gatherer.param_dtype)  # the traced gather casts as the Gatherer does
    new = nn.Parameter(sharded, requires_grad=param.requires_grad)
    new._gatherer = gatherer
    new._name = fqn
    gatherer.register(new)
    grad_sync.attach(new, handles, key=fqn)
    return new


def _refuse_parameters_sharded_elsewhere(module: nn.Module) -> None:
    """A parameter shared with a module that another ``shard_module`` call sharded would end up as two
    independent shards (two copies, two gradients): the tie breaks silently.  Refuse before replacing anything."""
    for name, param in module.named_parameters(remove_duplicate=False):
        earlier = getattr(param, "_name", "") if isinstance(param, ShardedParam) else \
            getattr(param, "_shardtensor_sharded_as", None)
        if isinstance(param, ShardedParam) or earlier is not None:
            raise ValueError(
                f"shard_module: parameter {name!r} of {type(module).__name__} is already sharded (as {earlier!r}) by "
                "another shard_module call (FSDP2's habit of fully_shard per block, then the root; or a module "
                "shared with one sharded separately). Fix: call shard_module once, on the root: its blocks "
                "become gather units by themselves (sharding a part again would untie it from the rest)."
            )


def _hook_loads(module: nn.Module, names: dict, handles: list) -> None:
    """Every module above a sharded parameter checks the full tensors a ``load_state_dict`` of it brings (see
    [Note: full tensors written into shards] in ``_agreement``)."""
    below: dict[str, dict] = {"": dict(names)}
    for fqn, param in names.items():
        parts = fqn.split(".")
        for depth in range(1, len(parts)):  # each module above it: its name there
            below.setdefault(".".join(parts[:depth]), {})[".".join(parts[depth:])] = param
    for module_name, submodule in module.named_modules():
        if module_name in below:
            handles.append(submodule.register_load_state_dict_pre_hook(
                functools.partial(_agreement.agree_on_load, below[module_name], module_name == "")))
    handles.append(module.register_load_state_dict_post_hook(_agreement.loaded))
    handles.append(module.register_state_dict_post_hook(_torch_state_dict.full_model_state_for_torch_helpers))


def _refuse_sparse_embeddings(module: nn.Module) -> None:
    """``nn.Embedding(sparse=True)`` gives its weight a sparse COO gradient, which has no rows to reduce-scatter:
    backward would fail inside the gradient hook with torch's "reshape is not implemented for sparse tensors"."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise ValueError(
                f"shard_module: {type(sub).__name__} {name!r} has sparse=True: its sparse gradient cannot be "
                "reduce-scattered to this rank's rows. Fix: build it with sparse=False (each rank keeps only its "
                "rows of the dense gradient; use torch.optim.Adam instead of SparseAdam).")


def _refuse_dtensor_parameters(module: nn.Module) -> None:
    """A DTensor parameter (tensor parallel, or fully_shard's) is already distributed; sharding it again is a 2-d
    layout (FSDP2 + TP) that shardtensor does not implement yet.  Fail before any parameter is replaced."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            fsdp = [n or "the root" for n, m in module.named_modules() if isinstance(m, FSDPModule)]
            raise NotImplementedError(
                f"shard_module: parameter {name!r} is already a DTensor (placements {tuple(param.placements)}, "
                f"mesh {tuple(param.device_mesh.shape)}); " + (
                    f"fully_shard (FSDP2) already shards {fsdp[0]!r}, and shard_module does the same job. Fix: drop "
                    "fully_shard and call shard_module once on the root (its blocks become gather units, as with "
                    "fully_shard per block)." if fsdp else "sharding tensor-parallel parameters is not supported "
                    "yet. Fix: call shard_module before parallelize_module, use fully_shard for 2-d (TP + FSDP) "
                    "layouts, or turn a 1-d Shard(0) DTensor into a ShardedParam with ShardedParam.from_dtensor."))


def _sharding_state(module: nn.Module) -> ShardingState:
    state = getattr(module, "_shardtensor", None)
    if state is None:
        raise ValueError(f"{type(module).__name__} was not sharded with shardtensor.shard_module")
    return state


def gather_stats(module: nn.Module) -> dict[str, int]:
    """Counters of the module's Gatherer (gathers, prefetches, prefetch hits, order mismatches, max alive)."""
    g = _sharding_state(module).gatherer
    return {"gathers": g.gathers, "prefetches": g.prefetches, "prefetch_hits": g.prefetch_hits,
            "mismatches": g.mismatches, "max_alive": g.max_alive}
