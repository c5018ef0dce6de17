"""``ShardedParam``: a wrapper tensor subclass whose data is this rank's dim-0 shard.

[Note: what a ShardedParam is]
The wrapper has the *global* shape, dtype and device; its only storage is ``_local``, this rank's rows of the
base tensor, padded with zero rows so every rank holds ``rows_per_rank`` rows (the all-gather then lands the
full tensor in rank order with no copy).  Ops reach ``__torch_dispatch__`` (below autograd) and are routed by
the op table in ``dispatch.py``.

[Note: views do not gather]
``F.linear`` calls ``t(weight)`` and autograd saves that view for backward.  If the view held the gathered
buffer, every full weight would live from forward to backward, which is exactly what sharding must avoid.  So a
view of a ShardedParam is another ShardedParam over the *same* ``_local`` that records the view (``_views``);
the chain is replayed on the gathered base tensor when a compute op needs the data.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from . import _comm, _compile


@dataclass(frozen=True)
class ShardLayout:
    """How one base tensor is split over a process group along dim 0 (immutable; shared by views and grads)."""

    shape: torch.Size  # global shape of the base tensor
    rows_per_rank: int  # padded rows each rank holds: ceil(shape[0] / world)
    rank: int
    world: int
    group: Any = None  # ProcessGroup or None (the default group); compared by identity

    @staticmethod
    def for_shape(shape: torch.Size, group=None) -> "ShardLayout":
        world = _comm.world_size(group)
        rows = -(-shape[0] // world) if shape[0] else 0
        return ShardLayout(torch.Size(shape), rows, _comm.rank(group), world, group)

    @property
    def row_start(self) -> int:
        return min(self.rank * self.rows_per_rank, self.shape[0])

    @property
    def valid_rows(self) -> int:
        """Rows of ``_local`` that hold data; the rest is padding (kept out of reductions and gathers)."""
        return max(0, min(self.rows_per_rank, self.shape[0] - self.rank * self.rows_per_rank))

    @property
    def padded_shape(self) -> torch.Size:
        return torch.Size((self.rows_per_rank * self.world, *self.shape[1:]))

    def local_shape(self) -> torch.Size:
        return torch.Size((self.rows_per_rank, *self.shape[1:]))

    # The collectives of a placement live on its layout, so another placement (layer-wise ownership, say) is a
    # layout subclass that overrides these three methods; gather.py and reduce.py only schedule them.
    def gather(self, local: torch.Tensor, *, async_op: bool = False) -> _comm.CollectiveResult:
        """Start gathering the full tensor; its first ``shape[0]`` rows of ``.buffer`` are the base tensor."""
        if _comm.world_size(self.group) != self.world:  # e.g. a shard unpickled in a process of another world
            raise RuntimeError(
                f"cannot gather a shard of {self.world} ranks (global shape {tuple(self.shape)}) in a process group "
                f"of {_comm.world_size(self.group)}: it was saved or built in another world. Load it with "
                "shardtensor.checkpoint_files.load_shards into a model sharded over the same world size."
            )
        return _comm.all_gather_rows(local, self.group, async_op=async_op)

    def gather_numel(self) -> int:
        """Elements a gather materialises (for prefetch budgets)."""
        return self.padded_shape.numel()

    def reduce_grad(self, grad: torch.Tensor, reducer, key: str) -> torch.Tensor:
        """This rank's ``local_shape()`` part of the mean over ranks of each rank's full gradient ``grad``."""
        with _comm.labelled(f"gradient reduction of {key!r}"):
            return reducer.reduce(self.pad(grad), key=key, group=self.group)

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` as ``(world * rows_per_rank, ...)``; copies only when the rows do not divide evenly."""
        full = full.contiguous()
        if full.shape[0] == self.padded_shape[0]:
            return full
        padded = torch.zeros(self.padded_shape, dtype=full.dtype, device=full.device)
        padded[: full.shape[0]].copy_(full)
        return padded

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded rows of a full (replicated) tensor of the base shape: a fresh tensor."""
        local = torch.zeros(self.local_shape(), dtype=full.dtype, device=full.device)
        if self.valid_rows:
            local[: self.valid_rows].copy_(full[self.row_start : self.row_start + self.valid_rows])
        return local


class ViewStep(NamedTuple):
    """One recorded view op, replayed on the gathered tensor: ``func(t, *args, **kwargs)[index]``."""

    func: Any  # torch._ops.OpOverload
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs, so the step is hashable
    index: Optional[int]  # output index of multi-output views (split, unbind), else None

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        out = self.func(t, *self.args, **dict(self.kwargs))
        return out if self.index is None else out[self.index]


@functools.lru_cache(maxsize=4096)
def _view_geometry(shape: torch.Size, views: tuple) -> tuple[torch.Size, tuple, int]:
    """Shape, stride and storage offset the view chain gives a contiguous base of ``shape`` (via meta tensors)."""
    t = torch.empty(shape, device="meta")
    for step in views:
        t = step.apply(t)
    return t.shape, t.stride(), t.storage_offset()


def apply_views(base: torch.Tensor, views: tuple) -> torch.Tensor:
    for step in views:
        base = step.apply(base)
    return base


class ShardedParam(torch.Tensor):
    """A parameter stored as this rank's dim-0 shard; looks like the full tensor to the code that uses it.

    Communication:
      - ``to_local()`` never communicates.
      - ``full_tensor()`` all-gathers (and is differentiable).
      - ``repr``/``str`` never communicate and never raise (debuggers call them).
    The raw constructor is not public API: use ``shardtensor.shard_module`` or ``ShardedParam.from_full``.
    """

    __slots__ = ["_local", "_layout", "_views", "_gatherer", "_name"]
    _local: torch.Tensor  # (rows_per_rank, *shape[1:]) of the base tensor; rows >= valid_rows are padding
    _layout: ShardLayout
    _views: tuple  # tuple[ViewStep, ...]; () for the base tensor
    _gatherer: Any  # gather.Gatherer that schedules this parameter's gathers, or None (on demand)
    _name: str

    # Outputs of torch functions must not be turned into ShardedParams by the default __torch_function__.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local, layout, views=(), gatherer=None, name="", requires_grad=False):
        shape, stride, offset = _view_geometry(layout.shape, views) if views else (layout.shape, None, 0)
        if stride is None:
            self = torch.Tensor._make_wrapper_subclass(
                cls, shape, dtype=local.dtype, device=local.device, requires_grad=requires_grad
            )
        else:
            self = torch.Tensor._make_wrapper_subclass(
                cls, shape, strides=stride, storage_offset=offset,
                dtype=local.dtype, device=local.device, requires_grad=requires_grad,
            )
        self._local = local
        self._layout = layout
        self._views = views
        self._gatherer = gatherer
        self._name = name
        return self

    # ------------------------------------------------------------------ constructors
    @classmethod
    def _from_local(cls, local, layout, *, views=(), gatherer=None, name="", requires_grad=False) -> "ShardedParam":
        return cls(local, layout, views, gatherer, name, requires_grad)

    @classmethod
    def from_full(cls, full: torch.Tensor, group=None, *, name: str = "", requires_grad: bool = False) -> "ShardedParam":
        """Shard a tensor that every rank holds in full (same values on every rank); keeps this rank's rows."""
        if full.dim() == 0:
            raise ValueError(f"ShardedParam.from_full: cannot shard a 0-d tensor along dim 0 ({name or 'tensor'})")
        if full.layout != torch.strided:
            raise NotImplementedError(
                f"ShardedParam.from_full: {name or 'tensor'} has layout {full.layout}; only dense (strided) tensors "
                "can be sharded. Fix: keep sparse parameters unsharded, or shard full.to_dense()."
            )
        layout = ShardLayout.for_shape(full.shape, group)
        return cls(layout.shard_of(full.detach()), layout, (), None, name, requires_grad)

    # ------------------------------------------------------------------ public API
    def to_local(self) -> torch.Tensor:
        """This rank's rows of the base tensor (padded; views not applied).  Never communicates."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The full tensor (views applied), gathered from all ranks.  Differentiable: grads flow back sharded."""
        return _FullTensor.apply(self)

    def to_dtensor(self):
        """This rank's rows as a ``DTensor`` with ``Shard(0)`` on a 1-d mesh of the layout's group (no copy).

        For ``torch.distributed.checkpoint`` and DTensor code.  DTensor's ``Shard(0)`` splits like
        ``torch.chunk``: ceil(rows / world) rows per rank, the last ranks shorter or empty.  That is our split
        without the zero padding, so the DTensor's local tensor is ``_local[:valid_rows]``, a view: writing into
        it (``dcp.load``) writes into this shard.  Needs an initialised process group (even for one process).
        """
        from torch.distributed.tensor import DTensor, Shard

        if self._views:
            raise ValueError(f"to_dtensor: {self._name or 'tensor'!r} is a view of a shard; call it on the parameter")
        layout = self._layout
        mesh = _comm.device_mesh(layout.group, self._local.device.type)
        stride = torch.empty(layout.shape, device="meta").stride()
        return DTensor.from_local(self._local[: layout.valid_rows], mesh, [Shard(0)], run_check=False,
                                  shape=layout.shape, stride=stride)

    @classmethod
    def from_dtensor(cls, dtensor, *, name: str = "", requires_grad: bool = False) -> "ShardedParam":
        """A ShardedParam over the same rows as a 1-d ``DTensor`` placed ``Shard(0)`` (or ``Replicate()``).

        The rows are copied into a padded shard (DTensor's last shards are short; ours are padded).  Other
        placements (``Shard(1)``, 2-d meshes: tensor parallel) raise: redistribute to ``Shard(0)`` first.
        """
        from torch.distributed.tensor import Replicate, Shard

        mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
        if mesh.ndim != 1 or placements not in ((Shard(0),), (Replicate(),)):
            raise NotImplementedError(
                f"ShardedParam.from_dtensor({name or 'tensor'!r}): placements {placements} on a {mesh.ndim}-d mesh; "
                "only a 1-d mesh with Shard(0) or Replicate() maps onto a ShardedParam. "
                "Fix: dtensor.redistribute(mesh, [Shard(0)]) first (or dtensor.full_tensor())."
            )
        group = _comm.default_group_or(mesh.get_group())
        local = dtensor.to_local().detach()
        if placements == (Replicate(),):
            return cls.from_full(local, group, name=name, requires_grad=requires_grad)
        layout = ShardLayout.for_shape(dtensor.shape, group)
        if local.shape[0] != layout.valid_rows:
            raise AssertionError(f"from_dtensor: rank {layout.rank} holds {local.shape[0]} rows of {tuple(dtensor.shape)}; "
                                 f"torch.chunk semantics give {layout.valid_rows}")
        padded = torch.zeros(layout.local_shape(), dtype=local.dtype, device=local.device)
        padded[: layout.valid_rows].copy_(local)
        return cls(padded, layout, (), None, name, requires_grad)

    @property
    def layout(self) -> ShardLayout:
        return self._layout

    @property
    def placement_name(self) -> str:
        return self._name

    def __repr__(self) -> str:  # never communicates, never raises
        try:
            layout = self._layout
            views = f", views={[step.func.__name__ for step in self._views]}" if self._views else ""
            name = f", name={self._name!r}" if self._name else ""
            grad = ", requires_grad=True" if self.requires_grad else ""
            return (
                f"ShardedParam(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"local_rows={layout.valid_rows}/{layout.rows_per_rank}, rank={layout.rank}/{layout.world}"
                f"{views}{name}{grad})"
            )
        except Exception as exc:  # noqa: BLE001 - a repr must not raise
            return f"ShardedParam(<unprintable: {type(exc).__name__}>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:  # never communicates
        try:
            return format(repr(self), spec)
        except (TypeError, ValueError):
            raise TypeError(
                f"format(ShardedParam, {spec!r}): a numeric format needs the values, and reading them gathers. "
                f"Use format(p.full_tensor().item(), {spec!r}) (gathers) or format this rank's rows from "
                "p.to_local(); string specs such as '>80' format the repr."
            ) from None

    # [Note: copies and pickles never communicate]
    # copy.copy shares the shard (as copy.copy of a tensor shares its storage).  copy.deepcopy copies the shard
    # and keeps the immutable layout (its process group is a handle that must not be copied); the copy is not
    # in the original's gather schedule, so its gathers run on demand.  Pickling (torch.save) stores this
    # rank's shard with its spec (global shape, rows per rank, rank, world, name) but not the process group:
    # ``torch.load(..., weights_only=True)`` rebuilds it (the rebuild function is allow-listed and validates the
    # spec), and a later gather checks that the live world is the saved one.  Views refuse to pickle.
    def __copy__(self) -> "ShardedParam":
        new = ShardedParam(self._local, self._layout, self._views, self._gatherer, self._name, self.requires_grad)
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo) -> "ShardedParam":
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                f"copy.deepcopy of ShardedParam {self._name!r}: only leaves (parameters, detached tensors) can be "
                "deep-copied, as with plain tensors. Fix: deepcopy p.detach()."
            )
        new = ShardedParam(copy.deepcopy(self._local, memo), self._layout, self._views, None, self._name,
                           self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        new.__dict__ = copy.deepcopy(self.__dict__, memo)
        return new

    def __reduce_ex__(self, protocol):
        if self._views:
            raise TypeError(
                f"cannot pickle a view of ShardedParam {self._name!r} (views: "
                f"{[step.func.__name__ for step in self._views]}). Save the parameter itself, or p.full_tensor()."
            )
        layout = self._layout
        if type(layout) is not ShardLayout:
            raise TypeError(
                f"cannot pickle ShardedParam {self._name!r} with a {type(layout).__name__}: only dim-0 layouts are "
                "picklable. Use shardtensor.full_state_dict(model) or shardtensor.checkpoint_files.save_shards."
            )
        spec = (tuple(layout.shape), layout.rows_per_rank, layout.rank, layout.world)
        return _rebuild_sharded_param, (self._local, spec, self._name, self.requires_grad, "_is_param" in self.__dict__)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return (_dispatch_op or _bind_dispatch())(func, args, kwargs or {})  # (the torch.compile check is there)

    # torch.compile / torch.export see through the wrapper (DTensor does the same).
    def __tensor_flatten__(self):
        return ["_local"], (self._layout, self._views, self._name)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        layout, views, name = ctx
        return ShardedParam(inner_tensors["_local"], layout, views, None, name)


_dispatch_op: Any = None  # dispatch.dispatch_op, bound on first use (import cycle: dispatch needs ShardedParam)


def _bind_dispatch():
    global _dispatch_op
    from .dispatch import dispatch_op

    _dispatch_op = dispatch_op
    return dispatch_op


def _declare_foreach_support() -> None:
    """List ShardedParam where torch decides between foreach and per-tensor code, as DTensor does for itself:
    ``clip_grad_norm_``'s default then takes ``_foreach_norm`` (one all-reduce for the whole model instead of one
    per gradient) and ``_foreach_mul_``, and torch.optim on CUDA takes its foreach path (a few dispatches per
    step instead of eight per parameter).  Our op table runs every ``_foreach_*`` op shard-wise."""
    try:
        from torch.optim.optimizer import _foreach_supported_types as optim_types
        from torch.utils._foreach_utils import _foreach_supported_types as util_types
    except ImportError:  # another torch: the per-tensor paths stay, and they are correct too
        return
    for types in (optim_types, util_types):
        if ShardedParam not in types:
            types.append(ShardedParam)


_declare_foreach_support()
_compile.skip_in_dynamo(ShardedParam.__torch_dispatch__)  # eager ops between compiled graphs are not re-traced


def _rebuild_sharded_param(local: torch.Tensor, spec: tuple, name: str, requires_grad: bool,
                           is_param: bool) -> ShardedParam:
    """Unpickle a ShardedParam (allow-listed for ``torch.load(weights_only=True)``): the spec is untrusted input."""
    shape, rows, rank, world = spec
    ok = (isinstance(local, torch.Tensor) and isinstance(shape, tuple) and len(shape) >= 1
          and all(isinstance(n, int) and n >= 0 for n in (*shape, rows, rank, world))
          and 0 <= rank < world and rows * world >= shape[0] and tuple(local.shape) == (rows, *shape[1:]))
    if not ok:
        raise ValueError(f"corrupt pickled ShardedParam {name!r}: spec {spec!r} does not fit a shard of shape "
                         f"{tuple(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__}")
    param = ShardedParam(local, ShardLayout(torch.Size(shape), rows, rank, world, None), (), None, str(name),
                         bool(requires_grad))
    if is_param:
        param._is_param = True  # what nn.Parameter(subclass) sets, so isinstance(param, nn.Parameter) holds
    return param


torch.serialization.add_safe_globals([_rebuild_sharded_param])


class _FullTensor(torch.autograd.Function):
    """Gather for the user; the incoming full gradient flows to the parameter unchanged (its hook shards it)."""

    @staticmethod
    def forward(ctx, param: ShardedParam) -> torch.Tensor:
        from .gather import gather_full

        return gather_full(param).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad
