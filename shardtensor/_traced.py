"""The traced path: what an op on a ShardedParam becomes while torch.compile traces it.

[Note: the traced path]
Dynamo wraps a ShardedParam as a traceable tensor subclass (``__tensor_flatten__``): its shard is a fake tensor
while Dynamo propagates shapes, and a functional fake tensor while AOTAutograd traces the forward and backward
graphs through ``__torch_dispatch__``.  Our eager rules cannot run there (the Gatherer's Python scheduling, its
identity-keyed buffers, blocking gloo collectives), so the dispatcher sends every op whose shard is fake here:

  - views (``t``, ``view``, ``detach``...) stay views: a ShardedParam over the same shard, no gather;
  - every other op gathers each ShardedParam it meets with a node of the graph (on gloo CPU a custom op over
    the eager collectives: the parameter's gather unit at once in overlapped mode, see [Note: unit gathers
    under compile]; the parameter alone in sequential mode, see [Note: a traced gather by broadcasts] in
    _comm_traced.py; elsewhere a functional all-gather, ``torch.distributed._functional_collectives``), cuts the
    padding rows, replays the views and runs the op on plain tensors.  The collective is a node of the graph,
    placed where its op reads it ([Note: a gather where it is read]).  Autograd saves the *view* (a ShardedParam
    over the shard), never the gathered tensor, so the backward graph gathers again where autograd's formulas
    read the parameter (``grad @ W``), as eager does: in sequential mode a 1-block GPT's graphs hold 17 gathers
    forward and 11 backward, and no full weight lives from forward to backward.

Autograd's formulas see plain tensors, so they give a parameter's gradient whole; the compiled backward
reduce-scatters it where it is complete, one node per parameter, and outputs this rank's shard (see [Note: a
gradient reduced inside the compiled backward] in ``_traced_grads.py``), which the eager gradient hook takes as
it is.  A pointwise op whose tensor operands are all ShardedParams of one layout runs on the traced shards, as in
eager (autograd adding the two reduced parts of a tied parameter's gradient); with a plain tensor beside them it
gathers, since that tensor may differ between ranks.  The optimizer step is not traced by
``torch.compile(model)``; a compiled function that runs it on real shards takes the eager rules.

The eager forward hooks (the step hook, gather units) stand aside while Dynamo traces; a gather unit is
gathered by one node per phase (below), its gradients are reduced one node each (merged into one per unit
under inductor: ``_traced_buckets.py``).
Mixed precision: the traced gather casts the shard to ``param_dtype`` before the collective, as the Gatherer
does, and the step hook casts the root's floating inputs (both traced).

``gather=`` under compile: ``"sequential"`` gathers each parameter where the graph reads it (one gather per read,
the lowest peak); ``"overlapped"`` (and ``"auto"``) gathers a gather unit's parameters together, once in the
forward and once in the backward (see [Note: unit gathers under compile]).

[Note: unit gathers under compile]
A graph node can only read what the graph has: the parameter an op names.  To gather a whole unit at its first
read, the traced path needs the graph's handle on every other parameter of the unit too.  AOTAutograd builds
those handles all at once, before it traces: it rebuilds each ShardedParam input from its traced shard with
``__tensor_unflatten__``, which records the shard under its layout (``note_traced_shard``).  The first read of
a unit's parameter in a phase (forward, or backward: an autograd node is running) emits one node that gathers
the unit, through the eager unit collectives (the shared-memory channel in overlapped mode, see
``_comm_shm``); later reads in the same phase reuse its outputs, and the phase in the node's arguments keeps the
compiler from merging the backward's gather into the forward's (which would keep full weights alive between
them).  Where the recorded shards are not this trace's (Dynamo's own shape propagation, before AOTAutograd), or
outside gloo CPU groups, the per-read gather stays.  In-place writes into parameters are refused inside
compiled code (``_dispatch/traced.py``), so a unit's gathered values cannot go stale within one graph.

[Note: the root unit under compile]
The root unit (the parameters of the module ``shard_module`` was given that no block holds: a GPT's embeddings,
final norm and head) is read at the forward's end (the head) and again at the backward's start (the head's
``grad @ W``), with only the loss between.  Its backward reads take the forward's gathered tensors (one phase
for both), as eager keeps the root's forward hold for its backward and FSDP2 does not reshard the root after
the forward: the compiler saves what the backward reads (the head's weight, alive at the forward's end anyway)
and the backward gathers no root unit: 6.5 MB less through the collective per step on the benchmark GPT.
(A root parameter read in the middle of the forward that the backward reads too is kept from the forward
on; a model with a large one should give it a unit of its own.)

[Note: a gather where it is read]
A gather node reads only graph inputs (the shards), so nothing stops the compiler from running it first: inductor
did, and every full weight lived from the graph's start (the per-read graph's step peak was 25% above eager
sequential mode's).  Each gather node therefore also takes the op's activation (its first tensor argument that is
not a parameter: the input of a linear, the gradient of a backward matmul) as an argument it does not read: the
node cannot run before the activation exists, so the weight is gathered where it is read and freed after its last
use, as in eager.
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
import weakref
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from . import _comm, _comm_traced
from ._layout import ShardLayout, apply_views


def _traced_shard(x: Any) -> bool:
    local = getattr(x, "_local", None) if isinstance(x, torch.Tensor) else None
    return local is not None and type(local) is not torch.Tensor and isinstance(local, (FakeTensor, FunctionalTensor))


def is_traced(args: tuple) -> bool:
    """Whether an op's arguments hold a ShardedParam whose shard is being traced (fake or functional)."""
    for x in args:
        if isinstance(x, (list, tuple)):
            if any(_traced_shard(t) for t in x):
                return True
        elif _traced_shard(x):
            return True
    return False


# Mixed precision under compile: a traced ShardedParam is rebuilt by ``__tensor_unflatten__`` from its flatten
# context, which holds the eager parameter's ShardLayout object itself but not its Gatherer.  shard_module records
# each layout's ``param_dtype`` here (by identity; the entry goes when the layout does).
_PARAM_DTYPES: dict[int, torch.dtype] = {}


def record_param_dtype(layout: Any, dtype: Optional[torch.dtype]) -> None:
    """Remember that gathers of ``layout``'s parameter cast to ``dtype`` (None: no cast)."""
    if dtype is None or id(layout) in _PARAM_DTYPES:
        return
    _PARAM_DTYPES[id(layout)] = dtype
    weakref.finalize(layout, _PARAM_DTYPES.pop, id(layout), None)


def param_dtype_of(layout: Any) -> Optional[torch.dtype]:
    """The dtype gathers of ``layout``'s parameter cast to (None: no cast)."""
    return _PARAM_DTYPES.get(id(layout))


# Units under compile: shard_module records each unit of a non-sequential mode under a key that is the same in
# every process of a job (it is baked into the graph and AOTAutograd's cache key), and each parameter's place.
_UNIT_OF: dict[int, tuple[str, int]] = {}  # id(layout) -> (unit key, position)
_TRACED_SHARDS: dict[int, weakref.ref] = {}  # id(layout) -> the traced shard __tensor_unflatten__ last built it over
_GATHERED: dict[str, tuple] = {}  # unit key -> (phase, weakrefs to the shards, the traced gathered tensors)
_unit_sets = itertools.count()


def unit_key_of(layout: Any) -> Optional[str]:
    """The key of the unit ``layout``'s parameter is gathered with under compile (None: none)."""
    place = _UNIT_OF.get(id(layout))
    return place[0] if place is not None else None


_ROOT_UNITS: set[str] = set()  # keys of root units: gathered once for the forward and the backward


def record_units(units: list, root: Any = None) -> None:
    """Make ``units`` (``_Unit``s of one UnitSet; ``root``: the unit of the module shard_module was given, if
    any) gatherable as one node each under compile."""
    number = next(_unit_sets)
    for unit in units:
        key = f"{number}/{unit.name}"
        if unit is root:
            _ROOT_UNITS.add(key)
            weakref.finalize(unit, _ROOT_UNITS.discard, key)
        _comm_traced.UNITS[key] = unit
        for position, param in enumerate(unit.params):
            layout = param._layout
            _UNIT_OF[id(layout)] = (key, position)
            weakref.finalize(layout, _forget, id(layout))


_GRAD_KEY_OF: dict[int, str] = {}  # id(layout) -> the key its gradient's reduction has in a compiled backward


def record_grad_key(layout: Any, key: str) -> None:
    """Remember the key under which a compiled backward reduces the gradient of ``layout``'s parameter (see
    ``_traced_grads.py``)."""
    if id(layout) not in _GRAD_KEY_OF:
        weakref.finalize(layout, _GRAD_KEY_OF.pop, id(layout), None)
    _GRAD_KEY_OF[id(layout)] = key


def grad_key_of(layout: Any) -> Optional[str]:
    """The key of ``record_grad_key`` (None: the eager hook reduces the gradient)."""
    return _GRAD_KEY_OF.get(id(layout))


def _forget(layout_id: int) -> None:
    _UNIT_OF.pop(layout_id, None)
    _TRACED_SHARDS.pop(layout_id, None)


def note_traced_shard(layout: Any, local: torch.Tensor) -> None:
    """``__tensor_unflatten__`` rebuilt a ShardedParam of ``layout`` over ``local``: remember a traced one."""
    if isinstance(local, FunctionalTensor) and id(layout) in _UNIT_OF:
        _TRACED_SHARDS[id(layout)] = weakref.ref(local)


def _cast(local: torch.Tensor, layout: Any) -> torch.Tensor:
    dtype = param_dtype_of(layout)
    return local.to(dtype) if dtype is not None and local.is_floating_point() and local.dtype != dtype else local


_AUTO_WARNED: "weakref.WeakSet" = weakref.WeakSet()  # Gatherers in gather="auto" mode told they compile as overlapped


def _unit_gather(param, after: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``param``'s full base tensor from its unit's gather in this phase (see [Note: unit gathers under
    compile]); None where the per-read gather applies."""
    layout, local = param._layout, param._local
    place = _UNIT_OF.get(id(layout))
    unit = _comm_traced.UNITS.get(place[0]) if place is not None else None
    if unit is not None and unit.gatherer.mode == "auto" and unit.gatherer not in _AUTO_WARNED:
        _AUTO_WARNED.add(unit.gatherer)
        warnings.warn("shardtensor: gather='auto' compiles as 'overlapped': a compiled graph's gathers are fixed "
                      "when it is traced, so it does not switch to sequential gathers when memory runs low. Fix: "
                      "shard_module(model, gather='sequential') for the lowest peak under torch.compile.",
                      stacklevel=2)
    if unit is None or not isinstance(local, FunctionalTensor) or not _comm.on_gloo_cpu(local.device, layout.group):
        return None
    key, position = place
    refs = [_TRACED_SHARDS.get(id(p._layout)) for p in unit.params]
    shards = [None if ref is None else ref() for ref in refs]
    if shards[position] is not local or any(s is None for s in shards):
        return None
    # (the root unit's one phase: see [Note: the root unit under compile])
    phase = 0 if key in _ROOT_UNITS else int(torch._C._current_autograd_node() is not None)
    done = _GATHERED.get(key)
    if done is not None and done[0] == phase and all(r() is s for r, s in zip(done[1], shards)):
        return done[2][position]
    fulls = _comm_traced.traced_unit_gather([_cast(s, p._layout) for s, p in zip(shards, unit.params)], key, phase,
                                            after)
    _GATHERED[key] = (phase, refs, fulls)  # held: an op reads one of them, the unit's later reads the others
    return fulls[position]


def traced_gather(param, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The full tensor of ``param`` (views applied) as traced ops: its unit's gather (see [Note: unit gathers
    under compile]), or a gather of the padded shard alone, then the padding rows cut off, once ``after`` (the
    op's activation) is computed (see [Note: a gather where it is read]).  Its result is an ordinary tensor of
    the graph."""
    layout = param._layout
    if type(layout) is not ShardLayout:
        raise NotImplementedError(
            f"torch.compile of ShardedParam {param._name!r} with a {type(layout).__name__}: only the dim-0 "
            "placement has a traced gather. Fix: shard with placement='dim0' to compile, or run eagerly."
        )
    full = _unit_gather(param, after) if layout.world > 1 else None
    if full is None:
        local = _cast(param._local, layout)
        if layout.world > 1:  # see [Note: a traced gather by broadcasts] in _comm_traced.py
            local = _comm_traced.traced_all_gather_rows(local, layout.group,
                                                        f"all-gather of {param._name!r} (compiled)", after)
        full = local[: layout.shape[0]]
    return apply_views(full, param._views)


_GRAPH_FORM = 5  # what the traced path emits (a cached graph of another form is not reused): unit gathers, `after`,
# the gradient reductions (whose keys the backward graph holds: a cached graph of another key is not reused)


def cache_fields(param) -> tuple:
    """What ``cache_key`` hashes: everything the traced path reads (global and local geometry, the group, the
    views, the gather's cast, the unit, the gradient's reduction key), and nothing that varies between processes
    of one job (object ids)."""
    layout, local = param._layout, param._local
    return (
        type(layout).__name__, tuple(param.shape), str(param.dtype), param.requires_grad,
        tuple(local.shape), tuple(local.stride()), str(local.dtype), str(local.device),
        tuple(getattr(layout, "shape", ())), getattr(layout, "rows_per_rank", None),
        getattr(layout, "rank", None), getattr(layout, "world", None),
        str(getattr(getattr(layout, "group", None), "group_name", "default")),
        repr(param._views), str(param_dtype_of(layout)), _UNIT_OF.get(id(layout)), _GRAD_KEY_OF.get(id(layout)),
        _GRAPH_FORM,
    )


def cache_key(param) -> str:
    """The key AOTAutograd's cache files a compiled graph under (``cache_fields``).  Without it torch warns, and
    its default key pickles the process group."""
    return hashlib.blake2b(repr(cache_fields(param)).encode(), digest_size=16).hexdigest()
