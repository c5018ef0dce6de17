"""Offload: homes for shards and optimizer state outside accelerator memory.

- ``NVMeOffload`` / ``NVMeCPUAdam``: optimizer state swapped to files, within a resident byte budget.
- ``CPUOffload``: parameter shards in pinned host memory, copied to the GPU before their gathers (CUDA only).
- ``SwapSpace``: the swap layer both build on (bounded I/O threads, aligned reused buffers, named errors).
- ``MemoryMonitor`` / ``shared_monitor``: the memory-pressure readings the Gatherer's auto mode also uses.
"""

from .cpu import CPUOffload
from .monitor import MemoryMonitor, shared_monitor
from .nvme import NVMeOffload, OffloadWriteError
from .nvme_adam import NVMeCPUAdam
from .swap import SwapError, SwapSpace, SwapWriteError

__all__ = ["CPUOffload", "NVMeOffload", "NVMeCPUAdam", "OffloadWriteError", "SwapSpace", "SwapError", "SwapWriteError",
           "MemoryMonitor", "shared_monitor"]
