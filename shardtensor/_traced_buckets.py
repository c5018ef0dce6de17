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

The pass also marks which gradients nothing in the graph reads afterwards (their node's only user is the
reduction and the op that made them returns a fresh tensor): a large one of those is reduced in its own tensor
([Note: direct gradients]) rather than copied first.  A rank's graphs are its own, but every rank compiles the
same graph to the same nodes; ranks that did not (a recompilation on one rank only) issue other collectives, and
the identity check before each names it.  Other backends (``aot_eager``) run no inductor pass and reduce per
parameter: the same numbers, more collectives.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Optional

import torch

_FORM = 1  # what the pass does (in its uuid: inductor's cache does not reuse a graph another form made)


def _read_nowhere_else(grad: torch.fx.Node) -> bool:
    """Whether ``grad`` (a reduction's input) is a fresh tensor that no other node of the graph reads."""
    target = grad.target
    return (grad.op == "call_function" and len(grad.users) == 1 and isinstance(target, torch._ops.OpOverload)
            and not any(ret.alias_info is not None for ret in target._schema.returns))


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
        keys = [n.args[1] for n in nodes]  # (a key twice: two reads of one parameter kept apart; reduced alone)
        nodes = [n for n in nodes if keys.count(n.args[1]) == 1]
        if not nodes:
            del by_unit[unit]
            continue
        grads = [n.args[0] for n in nodes]
        keys = [n.args[1] for n in nodes]
        owned = [_read_nowhere_else(g) for g in grads]
        with graph.inserting_before(nodes[-1]):
            merged = graph.call_function(torch.ops.shardtensor.reduce_grads.default, (grads, "\n".join(keys), owned))
            merged.meta["val"] = [n.meta.get("val") for n in nodes]
            for i, node in enumerate(nodes):
                item = graph.call_function(operator.getitem, (merged, i))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
        for node in nodes:
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
