"""Post-accumulate-grad hooks of a sharded parameter run when its reduced gradient has landed in ``.grad``.

[Note: gradient hooks run when the gradient lands]
Where the reduction of a gradient is deferred (a gather unit reduces its parameters together after the unit's
backward; ``gradient_sync(model, False)`` keeps full local gradients for a later backward), the parameter's
AccumulateGrad receives a zero placeholder shard, and the reduced rows are added to ``.grad`` later.  A hook
registered with ``register_post_accumulate_grad_hook`` (an optimizer stepping in backward, ``CPUAdam``'s
speculative steps, a gradient logger) that ran at AccumulateGrad would read zeros: silently wrong numbers, or
work that is always thrown away.  So, as FSDP2 runs these hooks after its reduce-scatter, a ``ShardedParam``
registers every such hook behind a guard: the code that hands AccumulateGrad a placeholder marks the parameter
(``placeholder_given``), the guard lets that one AccumulateGrad call pass without running the hook, and the code
that adds the reduced rows to ``.grad`` runs the hooks (``gradient_landed``).  Either order is right: if the
rows land before the placeholder's AccumulateGrad ran (the engine orders nodes, not hooks), the hooks run at the
landing and the guard still swallows the placeholder's call.  Tensor hooks (``register_hook``) run before
AccumulateGrad, on the placeholder, and cannot move: the README says so.
"""

from __future__ import annotations

from typing import Callable

import torch

_placeholders: set[int] = set()  # id(parameter): AccumulateGrad's next hook call is for a zero placeholder


class GuardedHook:
    """A user's post-accumulate-grad hook that skips the call for a placeholder (see the Note)."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[[torch.Tensor], None]):
        self.hook = hook

    def __call__(self, param: torch.Tensor) -> None:
        if id(param) in _placeholders:
            _placeholders.discard(id(param))  # this is AccumulateGrad storing the placeholder: wait for the rows
            return
        self.hook(param)


def _hooks(param: torch.Tensor) -> list:
    return list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values())


def placeholder_given(param: torch.Tensor) -> None:
    """``param``'s AccumulateGrad is about to receive a zero placeholder: its hooks wait for the reduced rows."""
    if any(isinstance(h, GuardedHook) for h in _hooks(param)):
        _placeholders.add(id(param))


def gradient_landed(param: torch.Tensor) -> None:
    """The reduced rows are in ``param.grad``: run the hooks AccumulateGrad was kept from running."""
    for hook in _hooks(param):
        if isinstance(hook, GuardedHook):
            hook.hook(param)


def forget_placeholders() -> None:
    """A backward that failed before its AccumulateGrad ran: no call is owed any more."""
    _placeholders.clear()
