"""A comm module (with ``_comm``): the context a collective is issued in, set by its caller.

A collective's label names it in every error it may raise (a timeout, a ``DivergenceError``); a compiled graph's
collectives say so in their labels (a rank whose peers run eagerly then learns that the model was compiled on
some ranks only); and only a caller that owns a reduce-scatter's input may let the collective use it as scratch.
Context variables, so a label set around a call reaches the collectives deep inside it.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

COMPILED = " (compiled)"  # the mark of a compiled graph's collectives in their labels (``_comm_divergence``)

_label: ContextVar[str] = ContextVar("shardtensor_collective_label", default="")
_in_graph: ContextVar[bool] = ContextVar("shardtensor_in_compiled_graph", default=False)
_overwritable: ContextVar[bool] = ContextVar("shardtensor_overwritable_inputs", default=False)


@contextlib.contextmanager
def _set(var: ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def labelled(text: str) -> contextlib.AbstractContextManager:
    """Name the collectives issued inside (``"all-gather of 'fc.weight'"``) for the errors they may raise."""
    return _set(_label, text)


def compiled_graph() -> contextlib.AbstractContextManager:
    """The collectives issued inside are a compiled graph's (a compiled backward's reductions): their labels end
    with ``COMPILED``, as the graph's gathers' do."""
    return _set(_in_graph, True)


def current_label(label: str = "") -> str:
    """``label``, else the innermost ``labelled`` text, marked where a compiled graph issues it."""
    label = label or _label.get()
    return label + COMPILED if _in_graph.get() and not label.endswith(COMPILED) else label


def inputs_may_be_overwritten(allowed: bool = True) -> contextlib.AbstractContextManager:
    """Let the reduce-scatters issued inside use their input as scratch (the caller owns it and drops it after).

    gloo's in-place ``reduce`` leaves partial sums in the rows it does not deliver; only a caller that holds the
    sole reference to the input (a gradient autograd hands over and nobody else holds) may allow that.
    """
    return _set(_overwritable, allowed)


def inputs_overwritable() -> bool:
    """Whether the caller's ``inputs_may_be_overwritten()`` lets collectives use their input as scratch."""
    return _overwritable.get()
