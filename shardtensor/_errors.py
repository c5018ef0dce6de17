"""Errors raised both by the op table and by modules it imports (a leaf, so that neither imports the other)."""


class ShardedOpError(RuntimeError):
    """An op cannot run on a ShardedParam without silently losing or corrupting data."""
