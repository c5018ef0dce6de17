"""The memory monitor now lives in the core (``shardtensor._memory``): the Gatherer reads it too, and the core
must not import the offload layer.  Re-exported here for the offload code and for users who imported it here."""

from shardtensor._memory import MemoryMonitor, shared_monitor

__all__ = ["MemoryMonitor", "shared_monitor"]
