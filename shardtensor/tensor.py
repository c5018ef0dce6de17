"""``ShardedParam``: a wrapper tensor subclass whose data is this rank's dim-0 shard.

[Note: what a ShardedParam is]
The wrapper has the *global* shape, dtype and device; its only storage is ``_local``, this rank's rows of the
base tensor, padded with zero rows so every rank holds ``rows_per_rank`` rows (the all-gather then lands the
full tensor in rank order with no copy).  Ops reach ``__torch_dispatch__`` (below autograd) and are routed by
the op table in the ``_dispatch`` package (bound as ``ShardedParam._op_dispatcher``).

[Note: views do not gather]
``F.linear`` calls ``t(weight)`` and autograd saves that view for backward.  If the view held the gathered
buffer, every full weight would live from forward to backward, which is exactly what sharding must avoid.  So a
view of a ShardedParam is another ShardedParam over the *same* ``_local`` that records the view (``_views``);
the chain is replayed on the gathered base tensor when a compute op needs the data.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, ClassVar, Optional

import torch

from . import _compile, _dtensor_bridge, _exports, _grad_edits, _traced
from ._layout import ShardLayout, ViewStep, apply_views, view_geometry  # noqa: F401  (ViewStep, apply_views: re-exported)
from ._full import full_tensor_of
from ._grad_landing import GuardedPostAccumulateHook, GuardedTensorHook


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

    # The op table's entry point, set when the ``_dispatch`` package is imported (the end of this module imports
    # it): a class attribute, as DTensor binds ``_op_dispatcher``, so the two modules import each other once.
    _op_dispatcher: ClassVar[Callable]

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: ShardLayout, *, views: tuple = (), gatherer: Any = None,
                name: str = "", requires_grad: bool = False, device: Optional[torch.device] = None) -> "ShardedParam":
        """The one constructor (keywords after the shard and its layout).  Not public API: use
        ``shardtensor.shard_module`` or ``ShardedParam.from_full``.

        ``device`` is where autograd sees the tensor (Default: the shard's).  It differs from the shard's only
        under ``CPUOffload``: the shard lives in host memory, the parameter and everything derived from it (its
        views, its shard-wise results) stay on the GPU, because autograd's engine syncs streams by the devices it
        recorded and aborts on a view that moved to the CPU."""
        shape, stride, offset = view_geometry(layout.shape, views) if views else (layout.shape, None, 0)
        if stride is None:
            self = torch.Tensor._make_wrapper_subclass(
                cls, shape, dtype=local.dtype, device=device or local.device, requires_grad=requires_grad
            )
        else:
            self = torch.Tensor._make_wrapper_subclass(
                cls, shape, strides=stride, storage_offset=offset,
                dtype=local.dtype, device=device or local.device, requires_grad=requires_grad,
            )
        self._local = local
        self._layout = layout
        self._views = views
        self._gatherer = gatherer
        self._name = name
        return self

    # ------------------------------------------------------------------ constructors
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
        return cls(layout.shard_of(full.detach()), layout, name=name, requires_grad=requires_grad)

    @classmethod
    def from_local(cls, local: torch.Tensor, layout: ShardLayout, *, name: str = "") -> "ShardedParam":
        """This rank's (padded) rows ``local`` as a tensor of ``layout``, sharing ``local``'s memory: per-rank state
        of a parameter's shard (an optimizer's moments) presented as shards of that parameter, so per-rank files
        keep whose rows they are and ``torch.distributed.checkpoint`` saves and reshards them as it does the
        parameter."""
        if tuple(local.shape) != tuple(layout.local_shape()):
            raise ValueError(f"ShardedParam.from_local: {name or 'tensor'} has shape {tuple(local.shape)}, but a "
                             f"shard of {tuple(layout.shape)} on rank {layout.rank} of {layout.world} has "
                             f"{tuple(layout.local_shape())}")
        return cls(local, layout, name=name)

    def _derived(self, local: torch.Tensor, views: Optional[tuple] = None, gatherer: Any = None) -> "ShardedParam":
        """A tensor of this one's placement and name over ``local``: a view or alias (``views``, ``gatherer``), a
        shard-wise result (views kept) or a new tensor of the global shape (``views=()``).  Its device is this one's
        while ``local`` stays beside this shard (under ``CPUOffload`` the shard is in host memory, the parameter on
        the GPU, and autograd must see derived tensors where the parameter is), else ``local``'s own
        (``p.to("cpu")`` moved it)."""
        device = self.device if local.device == self._local.device else local.device
        return ShardedParam(local, self._layout, views=self._views if views is None else views, gatherer=gatherer,
                            name=self._name, device=device)

    # ------------------------------------------------------------------ public API
    def to_local(self) -> torch.Tensor:
        """This rank's rows of the base tensor (padded; views not applied).  Never communicates."""
        _grad_edits.refuse_read_of_pending(self, "to_local()")
        return self._local

    def rehome_(self, local: torch.Tensor) -> "ShardedParam":
        """Make ``local`` this shard's storage (same shape and dtype; any device): offload keeps parameter and
        gradient shards in host memory this way while the wrapper stays on the compute device.  A scheduled
        parameter is rehomed through ``Gatherer.rehome_shards``, which re-indexes it."""
        if local.shape != self._local.shape or local.dtype != self._local.dtype:
            raise ValueError(f"rehome_ of {self._name or 'shard'!r}: {tuple(local.shape)} {local.dtype} does not "
                             f"match the shard's {tuple(self._local.shape)} {self._local.dtype}")
        self._local = local
        return self

    def full_tensor(self) -> torch.Tensor:
        """The full tensor (views applied), gathered from all ranks.  Differentiable: grads flow back sharded."""
        return full_tensor_of(self)

    def register_hook(self, hook: Callable[[torch.Tensor], Any]):
        """As ``torch.Tensor``'s; the hook receives this backward's *reduced* gradient, a sharded tensor (this
        rank's rows), and returns one like it or None.  Where the reduction lands after autograd is done with the
        parameter (a gather unit, ``gradient_sync(model, False)``), it runs then (see ``_grad_landing``)."""
        return super().register_hook(GuardedTensorHook(hook))

    def register_post_accumulate_grad_hook(self, hook: Callable[[torch.Tensor], None]):
        """As ``torch.Tensor``'s; the hook runs when this rank's reduced gradient shard is in ``.grad``, which
        in a gather unit or under ``gradient_sync(model, False)`` is after AccumulateGrad (see ``_grad_landing``)."""
        return super().register_post_accumulate_grad_hook(GuardedPostAccumulateHook(hook))

    # ``p.data = t`` (``vector_to_parameters``, hand-written updates) goes to torch's ``set_data``, which swaps the
    # wrapper's own (empty) storage and leaves ``_local``: every later op, gather and step would use the old values.
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """The full tensor (the same on every rank; this rank keeps its rows), or a tensor of this placement."""
        name = self._name or "sharded tensor"
        if isinstance(value, ShardedParam) and value._local is not self._local and value._gatherer is not None:
            raise ValueError(  # (only a parameter's own views and aliases carry its gatherer)
                f"{name!r}.data = {value._name!r}.data: torch would make the two parameters share storage, which "
                "sharded parameters cannot (each keeps its own rows), so they would silently train apart. Fix: tie "
                "them as one nn.Parameter before shard_module (m2.bias = m1.bias), or copy the values with "
                "p.copy_(q).")
        if isinstance(value, ShardedParam) and (value._layout, value._views, value.dtype) == (
                self._layout, self._views, self.dtype):
            if value._local is not self._local:
                with torch.no_grad():
                    self._local.copy_(value._local)
            return
        if isinstance(value, ShardedParam):
            raise ValueError(
                f"{name!r}.data = {value!r}: a sharded tensor of another placement, dtype or view (a transpose) "
                "cannot become this parameter's shard. Fix: p.copy_(value) (it gathers what it needs).")
        if not (not self._views and value.shape == self.shape and value.dtype == self.dtype
                and value.device == self.device):
            got = (f"{type(value).__name__}({tuple(value.shape)}, {value.dtype}, {value.device})"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise ValueError(
                f"{name!r}.data = {got}: a sharded parameter's .data takes the full tensor "
                f"({tuple(self.shape)}, {self.dtype}, {self.device}), the same on every rank, and keeps this rank's "
                "rows; its shape, dtype and device cannot change after shard_module. Fix: convert or resize the "
                "model before shard_module, or write values with p.copy_(full) (or p.to_local().copy_(rows)).")
        from . import _agreement  # see [Note: full tensors written into shards]

        _agreement.refuse_differing([(name, self, value.detach())], f"{name!r}.data = ...")
        with torch.no_grad():
            self._layout.copy_own_rows(self._local, value.detach())

    # A wrapper has no storage of its own: torch's share_memory_ on it crashed the process (SIGSEGV).  Sharing
    # this rank's rows is what model.share_memory() means here (worker processes then see the updated shard).
    def share_memory_(self) -> "ShardedParam":
        self._local.share_memory_()
        return self

    def is_shared(self) -> bool:
        return self._local.is_shared()

    # torch's own refusal ("not supported for tensor subclasses") names neither the way out nor the collective.
    def tolist(self):
        raise TypeError(self._host_copy_refusal("tolist"))

    def numpy(self, *, force: bool = False):
        raise TypeError(self._host_copy_refusal("numpy"))

    def __dlpack__(self, *args, **kwargs):
        # DLPack exports the wrapper's own storage, which holds nothing: torch.from_dlpack(p) crashed the process
        # (SIGSEGV) and numpy.from_dlpack(p) read memory that is not the parameter's.
        raise TypeError(self._host_copy_refusal("__dlpack__"))

    def storage(self):
        # No storage of its own: safetensors (save_pretrained(state_dict=...)) failed here with "data pointer on an
        # invalid python storage" (helper J).  untyped_storage() stays torch's: torch.compile asks every tensor.
        raise RuntimeError(self._storage_refusal())

    def _storage_refusal(self) -> str:
        return (f"ShardedParam {self._name or tuple(self.shape)!r} has no storage of its own: its values are spread "
                "over the ranks (p.to_local() is this rank's rows). A sharded model's state_dict() holds such shards: "
                "to save one with save_pretrained or safetensors, on every rank state = "
                "shardtensor.full_state_dict(model, rank0_only=True), then on rank 0 save_pretrained(path, "
                "state_dict=state).")

    def _host_copy_refusal(self, method: str) -> str:
        return (f"ShardedParam {self._name or tuple(self.shape)!r}.{method}(): the values are spread over the ranks. "
                f"Fix: p.full_tensor().{method}() (a gather: call it on every rank), or p.to_local().{method}() for "
                "this rank's rows.")

    def to_dtensor(self):
        """This rank's rows as a ``DTensor`` with ``Shard(0)`` on a 1-d mesh of the layout's group (no copy: a
        write into it, as ``dcp.load`` does, writes into this shard).  See ``_dtensor_bridge``."""
        return _dtensor_bridge.to_dtensor(self)

    # torch.distributed.checkpoint's protocol for tensors that hold part of a global tensor (DTensor implements
    # it): dcp.save writes only this rank's rows, dcp.load copies the overlapping rows of whatever ranks saved
    # into the shard in place (see [Note: checkpoint chunks come from the layout] in _dtensor_bridge.py).
    def __create_write_items__(self, fqn: str, obj: Any):
        return _dtensor_bridge.dcp_write_items(self, fqn)

    def __create_chunk_list__(self):
        return _dtensor_bridge.dcp_chunks(self)

    def __get_tensor_shard__(self, index):
        return _dtensor_bridge.dcp_shard(self)

    @classmethod
    def from_dtensor(cls, dtensor, *, name: str = "", requires_grad: bool = False) -> "ShardedParam":
        """A ShardedParam over the same rows as a 1-d ``DTensor`` placed ``Shard(0)`` (or ``Replicate()``); the
        rows are copied into a padded shard.  Other placements (tensor parallel) raise: see ``_dtensor_bridge``."""
        return _dtensor_bridge.from_dtensor(cls, dtensor, name, requires_grad)

    @property
    def shard_layout(self) -> ShardLayout:
        """How the base tensor is split (``ShardLayout``, or a placement subclass such as ``OwnerLayout``).

        Not ``layout``: that is ``torch.Tensor.layout`` (``torch.strided``), which torch's own code reads."""
        return self._layout

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
        new = ShardedParam(self._local, self._layout, views=self._views, gatherer=self._gatherer, name=self._name,
                           requires_grad=self.requires_grad, device=self.device)
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
        new = ShardedParam(copy.deepcopy(self._local, memo), self._layout, views=self._views, name=self._name,
                           requires_grad=self.requires_grad, device=self.device)
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
        _exports.warn_rows_pickled(self._name, layout.rank, layout.world)  # see [Note: exports of a shard's values]
        return _rebuild_sharded_param, (self._local, spec, self._name, self.requires_grad, "_is_param" in self.__dict__)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls._op_dispatcher(func, args, kwargs or {})  # (the torch.compile check is there)

    # torch.compile / torch.export see through the wrapper (DTensor does the same).
    def __tensor_flatten__(self):
        return ["_local"], (self._layout, self._views, self._name)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        layout, views, name = ctx
        _traced.note_traced_shard(layout, inner_tensors["_local"])  # (see [Note: unit gathers under compile])
        return ShardedParam(inner_tensors["_local"], layout, views=views, name=name)

    def _stable_hash_for_caching(self) -> str:
        """The key AOTAutograd's cache files a compiled graph under (see ``_traced.cache_key``)."""
        return _traced.cache_key(self)


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
_exports.guard_to_dlpack(ShardedParam)


def _keep_out_of_dynamo() -> None:
    _compile.skip_in_dynamo(ShardedParam.__torch_dispatch__)  # eager ops between compiled graphs are not re-traced
    # AOTAutograd's runtime wrappers rebuild ShardedParams between a compiled function's graphs: traced as frames,
    # they recompiled per shape and failed on a symbolic size (see [Note: backward hooks run eagerly] in _compile.py)
    _compile.skip_in_dynamo(ShardedParam.__tensor_unflatten__)
    _compile.skip_in_dynamo(ShardedParam.__tensor_flatten__)


_keep_out_of_dynamo()


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
    param = ShardedParam(local, ShardLayout(torch.Size(shape), rows, rank, world, None), name=str(name),
                         requires_grad=bool(requires_grad))
    if is_param:
        param._is_param = True  # what nn.Parameter(subclass) sets, so isinstance(param, nn.Parameter) holds
    return param


torch.serialization.add_safe_globals([_rebuild_sharded_param])


# Last: the op table's rules import ShardedParam, and importing the package binds ``ShardedParam._op_dispatcher``.
from . import _dispatch  # noqa: E402,F401
