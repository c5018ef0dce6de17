"""torch.compile around sharded modules: the eager op table stays out of Dynamo's frames.

While torch.compile traces, ops on ShardedParams take the traced path (see [Note: the traced path] in
``_traced.py``): gather nodes in the graph, no graph break.  The eager ``__torch_dispatch__`` frames
(and everything they call) are marked "skip" in Dynamo's frame evaluator, so an eager op that runs inside a
compiled region (fake propagation calls it) is never re-traced as Python.  This uses the C-level switch, so
importing shardtensor does not import ``torch._dynamo`` (seconds).

[Note: backward hooks run eagerly]
A ``loss.backward()`` inside a compiled function is a graph break: autograd runs it eagerly, but the frames it
calls into (our gradient hooks, the unit's pre-backward hook, the end-of-backward callbacks) are still handed to
Dynamo's frame evaluator, which traced them as new frames and failed inside them on a ShardedParam ("Expect size
to be a plain tuple of ints").  They are marked "skip" too: they run as in eager.  Hooks that a compiled graph
itself runs (the module forward hooks) are not: they stand aside while Dynamo traces.  The optimizer step's
global hooks, which Dynamo meets while tracing ``opt.step`` (not as frames), are ``torch._disable_dynamo``'d (see
[Note: a compiled optimizer step] in ``_dispatch/traced.py``).
"""

from __future__ import annotations

import torch


def _set_frame_strategy(fn, callees_too: bool) -> None:
    """Dynamo's frame evaluator runs ``fn``'s frame as it is (and, ``callees_too``, every frame it calls)."""
    frames = getattr(torch._C, "_dynamo", None)
    frames = getattr(frames, "eval_frame", None)
    if frames is None or not hasattr(frames, "set_code_exec_strategy"):  # older torch: compile may trace into us
        return
    action = frames._FrameAction
    callees = action.SKIP if callees_too else action.DEFAULT
    frames.set_code_exec_strategy(getattr(fn, "__func__", fn).__code__, frames._FrameExecStrategy(action.SKIP, callees))


def skip_in_dynamo(fn) -> None:
    """Tell Dynamo's frame evaluator never to trace ``fn`` or anything it calls (no ``torch._dynamo`` import)."""
    _set_frame_strategy(fn, callees_too=True)


def compile_callees_only(fn) -> None:
    """Tell Dynamo's frame evaluator to run ``fn``'s own frame as it is, and to compile the frames it calls as
    usual.  For a wrapper of many callables (one code object, ``_hooks.PickleRefusingHook.__call__``): Dynamo
    compiles a compiled root module's hooks as frames of their own, and compiled the wrapper's frame once per
    hook and grad mode, past its recompile limit (a hard failure under ``fullgraph=True``); each hook's own frame
    is now compiled for itself.  Inside a traced forward (a block's hooks) Dynamo inlines the wrapper as before."""
    _set_frame_strategy(fn, callees_too=False)
