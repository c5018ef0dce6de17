"""The wrapper every module hook of shardtensor's goes through (``shard_module``'s root hooks, a gather unit's).

It does two things a bare closure did not:

- Pickling or deep-copying the model reaches the hooks first: they refuse by name, with the fix (a closure failed
  with "Can't pickle local object", naming neither the cause nor the fix).
- The hook runs outside the user's dispatch modes.  Our hooks' tensor work (gathers, waits, frees, finishing
  pending reductions) ran inside whatever ``TorchDispatchMode`` the user pushed around the forward.  Selective
  activation checkpointing (``create_selective_checkpoint_contexts``) is one: it records every op of the region
  in the forward and requires its recompute to run the very same ops, and ours depend on timing (an overlapped
  gather already landed, a reduction still pending).  The recompute met an op the forward never ran: torch's
  error on one rank while the others waited in a collective.  Nothing a user's mode wants to see or change is in
  that work (the ops inside ``ShardedParam.__torch_dispatch__`` are out of such modes already, as every nested
  op is).  Infra modes (fake tensors, proxy tracing) are left alone, and so is code Dynamo traces.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils import _python_dispatch

from . import _compile, _frames

DEEPCOPY_REFUSAL = ("copy.deepcopy of a module sharded by shardtensor.shard_module is not supported: its gradient "
                    "hooks and gather schedule belong to the original, so the copy's gradients would silently stop "
                    "being averaged across ranks. Fix: deepcopy before shard_module and shard the copy, or build a "
                    "fresh model, shard it, and load shardtensor.full_state_dict(model) into it. (copy.deepcopy of "
                    "a single ShardedParam is supported: it copies the shard.)")


class PickleRefusingHook:
    """A module hook of shardtensor's: refuses pickling and deep copies by name, runs outside the user's dispatch
    modes (see the module docstring)."""

    __slots__ = ("fn", "builds_graph")

    def __init__(self, fn: Callable, *, builds_graph: bool = False):
        self.fn = fn
        self.builds_graph = builds_graph  # adds autograd nodes: it leaves torch.func transforms on around those

    def __call__(self, *args, **kwargs):
        # (Dynamo inlines this wrapper inside a traced forward; elsewhere it runs this frame as it is, so the
        # builtin below is called, not traced, and compiles the frames it calls: see _compile.compile_callees_only)
        if torch.compiler.is_compiling() or not (torch._C._len_torch_dispatch_stack()
                                                 or torch._C._functorch.peek_interpreter_stack()):
            return self.fn(*args, **kwargs)
        with outside_user_dispatch_modes(), \
                (contextlib.nullcontext() if self.builds_graph else outside_functorch_transforms()):
            return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        if _frames.inside("__init__", "swa_utils"):  # AveragedModel deep-copies the module it is given
            raise TypeError(DEEPCOPY_REFUSAL + " torch.optim.swa_utils.AveragedModel deep-copies its module: build "
                            "it before shard_module (ema = AveragedModel(model); shard_module(model); "
                            "shard_module(ema)), then update_parameters(model) as usual.")
        raise TypeError(DEEPCOPY_REFUSAL)

    def __reduce_ex__(self, protocol):
        raise TypeError(PICKLE_REFUSAL)


PICKLE_REFUSAL = ("pickling a module sharded by shardtensor.shard_module (torch.save(model), pickle.dumps(model)) is"
                  " not supported: its gradient hooks and gather schedule belong to this process and its ranks. Fix:"
                  " save the state instead: shardtensor.save_checkpoint(dir, model, opt), or state = shardtensor."
                  "full_state_dict(model, rank0_only=True) on every rank and torch.save(state, f) on rank 0; to "
                  "restore, build the model, shard it and load the state.")


def outside_user_dispatch_modes() -> contextlib.AbstractContextManager:
    """A context that pops the user's dispatch modes for its duration (a no-op where there are none, or where an
    infra mode is among them)."""
    modes = _python_dispatch._get_current_dispatch_mode_stack()
    if not modes or any(mode.is_infra_mode() for mode in modes):
        return contextlib.nullcontext()
    return _python_dispatch._disable_current_modes()


def outside_functorch_transforms() -> contextlib.AbstractContextManager:
    """A context outside ``torch.func`` transforms (``jacrev``, ``grad``, ``vmap`` of a sharded model with respect
    to its input): a hook's gathers and reductions are not part of the function transformed.  Inside one, every
    tensor created is the transform's (a wrapper without storage), and our collectives had nothing to send from
    (torch's "Cannot access data pointer" in overlapped mode, where a unit's gathers start in its forward hook).
    A hook that adds autograd nodes (a gather unit's) keeps those inside and its collectives in here."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return contextlib.nullcontext()
    return torch._C._DisableFuncTorch()


_compile.skip_in_dynamo(outside_user_dispatch_modes)
_compile.skip_in_dynamo(outside_functorch_transforms)
