"""The op table: what each aten op does when it meets a ``ShardedParam``.

Five classes of rule, one module each:
  1. ``views``       -> a ShardedParam over the same shard that records the view (no gather)
  2. ``local``       -> pointwise / foreach / fused-optimizer ops on shards of one placement run on the shards
  3. ``reductions``  -> whole-tensor sum / norm / max...: local reduction + one all-reduce, a replicated result
  4. ``compute``     -> everything else: gather the full tensors, run, release; outputs are plain tensors
  5. ``refusals``    -> an op that would write into a ShardedParam but cannot run on shards raises, naming the op
plus ``sequential``: the decompositions that keep ``gather="sequential"`` at one gathered parameter per op.

Every rule is registered with ``@implements`` (``_common.py``); importing this package binds ``dispatch_op`` as
``ShardedParam._op_dispatcher`` (the one import cycle of the library: tensor.py <-> this package).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import _grad_edits
from ..tensor import ShardedParam
from . import reductions, row_writes, sequential, traced, views  # noqa: F401  (importing a rule module registers its rules)
from ._common import FAMILIES, TABLE, OpFamily, Rule, ShardedOpError, implements
from .compute import compute
from .local import _local, _whole_shard

__all__ = ["dispatch_op", "implements", "OpFamily", "ShardedOpError", "TABLE", "FAMILIES", "rule_for"]

_RULE_BY_ID: dict[int, Rule] = {}  # id(OpOverload) -> rule; OpOverloads live as long as the process


def dispatch_op(func, args: tuple, kwargs: dict):
    """Run ``func`` by its rule (looked up once per op; keyed by id: ``OpOverload.__hash__`` is a Python method)."""
    if _grad_edits.logging_scales():  # a .grad holds a no_sync deferral: what may touch it is limited
        refusal = _grad_edits.refusal_of_use_of_pending(func, args, kwargs, _whole_shard)
        if refusal is not None:
            raise ShardedOpError(refusal)
    rule = _RULE_BY_ID.get(id(func))
    if rule is None:
        rule = rule_for(func)
        if func.is_view and rule is compute:  # a composite view, met undecomposed: see _decomposed_view
            rule = _decomposed_view
        rule = _checked(rule)
        rule = _RULE_BY_ID[id(func)] = _outside_inference_mode(rule) if func.is_view else rule
    return rule(func, args, kwargs)


def _decomposed_view(func, args, kwargs):
    """A composite view op (``narrow``, ``flatten``, ``movedim``, ``T``, ``view_as``...) as the primitive views it
    is made of, each recorded on the shard by its rule.  Autograd decomposes these before they reach us, but
    under ``torch.inference_mode()`` they arrive whole, and the fallback's gathered copy took a write through
    them (``w.narrow(0, 3, 5).zero_()``) and dropped it, silently.  An op with no decomposition is computed."""
    out = func.decompose(*args, **kwargs)
    return compute(func, args, kwargs) if out is NotImplemented else out


def _outside_inference_mode(rule: Rule) -> Rule:
    """A view op's rule, run outside ``torch.inference_mode()`` when its input is a normal tensor.  Why: torch makes
    a view of a normal tensor a normal tensor even in inference mode (autograd's ADInplaceOrView kernel then gives
    it its base's version counter), but whatever a rule creates in inference mode (our view's wrapper, a narrowed
    copy of a gathered weight) is an inference tensor, which refuses that: "Cannot set version_counter for
    inference tensor" (``nn.Transformer``'s cross-attention splits its packed weight, under ``inference_mode``)."""
    def run(func, args, kwargs, rule: Callable = rule):
        if torch.is_inference_mode_enabled() and not args[0].is_inference():
            with torch.inference_mode(False), torch.no_grad():
                return rule(func, args, kwargs)
        return rule(func, args, kwargs)

    return run


def rule_for(func) -> Rule:
    """The rule of ``func``: its overload's, else its packet's, else the first declared family's, else compute."""
    rule = TABLE.get(func) or TABLE.get(func.overloadpacket)
    if rule is not None:
        return rule
    for family, family_rule in FAMILIES:
        if family.contains(func):
            return family_rule
    return compute


def _checked(rule: Rule) -> Rule:
    """``rule`` behind the torch.compile check (see [Note: the traced path] in _traced.py).  The local rule makes
    the check itself, after its fast path: a pointwise op on real shards (hundreds per optimizer step) skips it."""
    if rule is _local:
        return rule

    def checked(func, args, kwargs, rule: Callable = rule):
        if traced.is_traced(args):  # torch.compile: see [Note: the traced path] in _traced.py
            return traced.run_traced(func, args, kwargs, rule)
        return rule(func, args, kwargs)

    return checked


ShardedParam._op_dispatcher = dispatch_op
