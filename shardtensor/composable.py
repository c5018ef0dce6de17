"""Switches for FSDP-style training code: ``gradient_sync`` (``no_sync``) and ``unshard_module``."""

from __future__ import annotations

import torch
from torch import nn

from . import _misuse_optim, _traced_grads
from ._sync_switch import SyncSwitch, detach_habits
from .api import _sharding_state
from .gather import gather_full
from .tensor import ShardedParam


class gradient_sync(SyncSwitch):  # noqa: N801 - used like a function, as FSDP's no_sync / set_requires_gradient_sync
    """Turn gradient reduction of a sharded module off (``False``) or on (``True``); also a context manager.

    Off, each backward keeps the *full* local gradient of every parameter in a side buffer (one full tensor
    per parameter: memory traded for communication) and ``param.grad`` gets a zero shard.  The next backward
    with sync on adds the buffers to its gradients and reduces once, so the gradient equals the one reduced
    after every micro-batch.  See [Note: deferred gradient sync] in reduce.py.

        with shardtensor.gradient_sync(model, False):
            for x in micro_batches[:-1]:
                model(x).sum().backward()            # no communication
        model(micro_batches[-1]).sum().backward()    # one reduce-scatter per parameter
        opt.step()

    Called without ``with`` it just sets the switch.  The last backward before ``opt.step()`` must run with
    sync on, and must reach every parameter whose gradients were deferred.  ``model.no_sync()`` (DDP's name) and
    ``model.set_requires_gradient_sync(flag)`` (FSDP2's) are the same switch.
    """

    def __init__(self, module: nn.Module, enabled: bool):
        super().__init__(_sharding_state(module).grad_sync, enabled)


@torch.no_grad()
def unshard_module(module: nn.Module) -> nn.Module:
    """Turn a sharded module back into a plain one, in place (for export, inference, or re-sharding).

    Every ``ShardedParam`` is gathered (a collective: every rank must call this) into a plain ``nn.Parameter``
    with the same ``requires_grad``; sharded gradients are gathered too; tied parameters stay tied; the
    gradient hooks and the forward pre-hook are removed.  Optimizers built on the sharded parameters still hold
    the old ones: build a new optimizer.
    """
    state = _sharding_state(module)
    if state.grad_sync._deferred:
        raise ValueError(
            f"unshard_module: gradients of {sorted(state.grad_sync._deferred)[:3]} are deferred by "
            "gradient_sync(module, False); run a backward with sync on first"
        )
    state.gatherer.drop_cache()
    _misuse_optim.note_unsharded(state.gatherer)
    for handle in state.hook_handles:
        handle.remove()
    replaced: dict[int, nn.Parameter] = {}
    for _, submodule in module.named_modules(remove_duplicate=False):
        for name, param in list(submodule._parameters.items()):
            if not isinstance(param, ShardedParam):
                continue
            if id(param) not in replaced:
                plain = nn.Parameter(gather_full(param).clone(), requires_grad=param.requires_grad)
                if param.grad is not None:
                    grad = param.grad
                    plain.grad = gather_full(grad).clone() if isinstance(grad, ShardedParam) else grad.clone()
                replaced[id(param)] = plain
            submodule._parameters[name] = replaced[id(param)]
        _traced_grads.stop_reading_through_boundaries(submodule)
    del module._shardtensor
    detach_habits(module)
    module.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)  # DDP may wrap it now (see _misuse.RefuseDDP)
    return module
