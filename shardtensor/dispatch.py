"""Compatibility: the op table is the ``shardtensor._dispatch`` package; ``ShardedOpError`` is importable here."""

from ._dispatch import ShardedOpError, dispatch_op, implements  # noqa: F401
