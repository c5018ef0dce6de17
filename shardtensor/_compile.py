"""torch.compile around sharded modules: graph breaks at every op on a ShardedParam.

[Note: torch.compile]
``ShardedParam`` implements ``__tensor_flatten__`` / ``__tensor_unflatten__``, so Dynamo wraps it as a tensor
subclass and propagates fake tensors through ``__torch_dispatch__``.  Our op table cannot run on fake shards:
its compute rules all-gather through gloo/NCCL with Python-side scheduling (the Gatherer's recorded order,
prefetch, reuse window), and the gradient hooks reduce-scatter.  Tracing that into a graph would mean functional
collectives and a compiled gather schedule (what DTensor and FSDP2's compiled path do); not done yet.  So:

  - while Dynamo traces (the shards are ``FakeTensor``s), every op that meets a ShardedParam raises
    ``UnsupportedOperatorException``, which Dynamo turns into a graph break: that op runs eagerly, and the code
    between such ops (activations, residual adds, norms of plain tensors, the loss) is compiled;
  - the frames of ``ShardedParam.__torch_dispatch__`` (and everything it calls) are marked "skip" in Dynamo's
    frame evaluator, so the eager op is not itself re-traced.  This uses the C-level switch, so importing
    shardtensor does not import ``torch._dynamo`` (seconds).

What breaks: one graph break per op that reads a parameter (``linear``'s ``t``, ``embedding``, ``layer_norm``...);
the compiled graphs hold only parameter-free code.  Losses equal eager (tested in test_composability.py).
"""

from __future__ import annotations

import torch

_FakeTensor = torch._subclasses.fake_tensor.FakeTensor  # imported by ``import torch`` (no extra cost)


def break_graph_if_traced(func, args: tuple) -> None:
    """Raise Dynamo's graph-break exception when ``func`` meets a ShardedParam whose shard is fake."""
    for x in args:
        if isinstance(x, (list, tuple)):
            x = x[0] if x else None
        local = getattr(x, "_local", None) if isinstance(x, torch.Tensor) else None
        if local is not None and type(local) is not torch.Tensor and isinstance(local, _FakeTensor):
            from torch._subclasses.fake_tensor import UnsupportedOperatorException

            raise UnsupportedOperatorException(func)


def skip_in_dynamo(fn) -> None:
    """Tell Dynamo's frame evaluator never to trace ``fn`` or anything it calls (no ``torch._dynamo`` import)."""
    frames = getattr(torch._C, "_dynamo", None)
    frames = getattr(frames, "eval_frame", None)
    if frames is None or not hasattr(frames, "set_code_exec_strategy"):  # older torch: compile may trace into us
        return
    skip = frames._FrameAction.SKIP
    frames.set_code_exec_strategy(getattr(fn, "__func__", fn).__code__, frames._FrameExecStrategy(skip, skip))
