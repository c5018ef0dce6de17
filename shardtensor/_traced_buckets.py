"""Under inductor, a gather unit's gradients are reduced together: one reduce-scatter per unit, not per parameter.

[Note: a unit's gradients reduced together under compile]
Each trainable ShardedParam's gradient boundary puts a ``reduce_grad`` node into the compiled backward (see
``_traced_grads.py``), each a collective behind its own identity check: on the benchmark GPT, 52 reductions per
step where the eager step issues one per unit (5), and each is a meeting of the ranks, whose waits add up (cProfile of
warm compiled steps: 0.11 s of each in the reductions).  The compiler cannot bucket an opaque op, so a post-grad pass
of ours does (registered with inductor's ``post_grad_custom_post_pass``, beside any pass of the user's): the
``reduce_grad`` nodes of one unit (the unit key rides in each node, so the graph, and with it every cache key,
says which) become one ``reduce_grads`` node at the place of the unit's last one, whose kernel reduce-scatters
them all through the unit's shared memory as the eager unit reduction does.  The unit's whole gradients then
live until its last one is computed, as in the eager overlapped step.

A tied parameter has one ``reduce_grad`` node per read (its head's and its embedding's parts): the pass adds
the parts and reduces the sum once, and hands the other reads zeros (autograd adds every read's shard into the
one gradient).  The pass also marks which gradients nothing in the graph reads afterwards (their node's only
user is the reduction and the op that made them returns a fresh tensor): a large one of those is reduced in its
own tensor ([Note: direct gradients]) rather than copied first.  A rank's graphs are its own, but every rank
compiles the same graph to the same nodes; ranks that did not (a recompilation on one rank only) issue other
collectives, and the identity check before each names it.  Other backends (``aot_eager``) run no inductor pass
and reduce per parameter: the same numbers, more collectives.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Optional

import torch

_FORM = 2  # what the pass does (in its uuid: inductor's cache does not reuse a graph another form made)


def _read_nowhere_else(grad: torch.fx.Node) -> bool:
    """Whether ``grad`` (a reduction's input) is a fresh tensor that no other node of the graph reads."""
    target = grad.target
    return (grad.op == "call_function" and len(grad.users) == 1 and isinstance(target, torch._ops.OpOverload)
            and not any(ret.alias_info is not None for ret in target._schema.returns))


def _fake_result(fn, *args):
    """``fn`` run on the fake values of the nodes ``args`` (a new node's ``meta["val"]``)."""
    vals = [a.meta["val"] for a in args]
    with torch._guards.detect_fake_mode(vals):
        return fn(*vals)


def _summable(parts: list[torch.fx.Node]) -> bool:
    vals = [p.args[0].meta.get("val") for p in parts]
    return all(isinstance(v, torch.Tensor) for v in vals) and len({(tuple(v.shape), v.dtype) for v in vals}) == 1


def merge_unit_reductions(graph: torch.fx.Graph) -> int:
    """Replace each unit's ``reduce_grad`` nodes in ``graph`` by one ``reduce_grads`` node; the number of units
    merged."""
    single = torch.ops.shardtensor.reduce_grad.default
    by_unit: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is single and node.args[2]:
            by_unit.setdefault(node.args[2], []).append(node)
    if not by_unit:
        return 0
    for unit, nodes in list(by_unit.items()):
        parts: dict[str, list[torch.fx.Node]] = {}  # key -> its reductions (a tied parameter: one per read)
        for node in nodes:
            parts.setdefault(node.args[1], []).append(node)
        keys = [key for key, ps in parts.items() if _summable(ps)]  # (others: reduced alone, as they came)
        if not keys:
            del by_unit[unit]
            continue
        with graph.inserting_before(nodes[-1]):
            grads = []
            for key in keys:  # the parts of a tied parameter's gradient summed, then reduced once
                grad = parts[key][0].args[0]
                for other in parts[key][1:]:
                    grad = graph.call_function(torch.ops.aten.add.Tensor, (grad, other.args[0]))
                    grad.meta["val"] = _fake_result(torch.add, *grad.args)
                grads.append(grad)
            owned = [_read_nowhere_else(g) for g in grads]
            merged = graph.call_function(torch.ops.shardtensor.reduce_grads.default, (grads, "\n".join(keys), owned))
            merged.meta["val"] = [parts[key][0].meta.get("val") for key in keys]
            for i, key in enumerate(keys):
                item = graph.call_function(operator.getitem, (merged, i))
                item.meta.update(parts[key][0].meta)
                parts[key][0].replace_all_uses_with(item)
                for other in parts[key][1:]:  # the sum is in the first part's shard; autograd adds these
                    val = item.meta["val"]
                    zeros = graph.call_function(torch.ops.aten.full.default, (list(val.shape), 0.0),
                                                {"dtype": val.dtype, "device": val.device, "pin_memory": False})
                    zeros.meta["val"] = _fake_result(torch.zeros_like, item)
                    other.replace_all_uses_with(zeros)
        for key in keys:
            for node in parts[key]:
                graph.erase_node(node)
    # (a use of an earlier reduction may now come before the merged node: move it after)
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)
    return len(by_unit)


_PASS: list = []  # the pass, built at the first install (importing inductor costs 1.5 s: not at import)


def install() -> None:
    """Add the pass to inductor's post-grad passes, once, beside any the user set.  Called while AOTAutograd
    traces a gradient boundary, before inductor runs any pass on that graph: a script that never compiles never
    imports inductor for it."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if not _PASS:
        class MergeUnitReductions(CustomGraphPass):
            """``merge_unit_reductions`` as inductor's post-grad pass."""

            def __call__(self, graph: torch.fx.Graph) -> None:
                merge_unit_reductions(graph)

            def uuid(self) -> Optional[Any]:
                return hashlib.sha256(f"shardtensor.merge_unit_reductions/{_FORM}".encode()).hexdigest()

        _PASS.append(MergeUnitReductions())
    current = inductor_config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else [] if current is None else [current]
    if not any(p is _PASS[0] for p in passes):
        inductor_config.post_grad_custom_post_pass = passes + _PASS if passes else _PASS[0]
