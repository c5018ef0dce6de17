"""Where a ShardedParam's values would leave through a door that does not go through its methods.

[Note: exports of a shard's values]
``torch.utils.dlpack.to_dlpack(p)`` (also ``torch.to_dlpack``) is a C builtin that never asks ``p.__dlpack__``: it
exported the wrapper's own storage, which holds nothing (data pointer 0), and the consumer's first read crashed
the process (SIGSEGV; helper I: the JAX/CuPy interop recipe ``from_dlpack(to_dlpack(x))``).  So at import the two
names are wrapped: a sharded tensor is refused with the same ``TypeError`` as ``numpy()``, any other passes to
torch's function untouched.  Code that bound the builtin before importing shardtensor keeps it.

``torch.save`` of a sharded state dict stores this rank's rows (that is what makes per-rank files work), so
``if rank == 0: torch.save(model.state_dict(), path)``, the DDP habit, wrote rank 0's rows alone and said nothing
until a resume was refused (helper J).  The first pickle of a shard in a process warns, naming the routes.
"""

from __future__ import annotations

import warnings

import torch

_warned = [False]


def guard_to_dlpack(sharded_type: type) -> None:
    original = torch.utils.dlpack.to_dlpack
    if getattr(original, "_shardtensor_guard", False):
        return

    def to_dlpack(tensor, *args, **kwargs):
        if isinstance(tensor, sharded_type):
            raise TypeError(
                f"to_dlpack of ShardedParam {tensor._name or tuple(tensor.shape)!r}: the values are spread over the "
                "ranks. Fix: to_dlpack(p.full_tensor()) (a gather: call it on every rank), or to_dlpack(p.to_local()) "
                "for this rank's rows.")
        return original(tensor, *args, **kwargs)

    to_dlpack._shardtensor_guard = True
    to_dlpack.__doc__ = original.__doc__
    torch.utils.dlpack.to_dlpack = to_dlpack
    if getattr(torch, "to_dlpack", None) is original:
        torch.to_dlpack = to_dlpack


def warn_rows_pickled(name: str, rank: int, world: int) -> None:
    if _warned[0] or world == 1:
        return
    _warned[0] = True
    warnings.warn(
        f"pickling sharded tensor {name!r} (torch.save of a sharded model's state_dict()) stores rank {rank}'s rows "
        f"of {world} only: a checkpoint needs every rank's own file, loaded back at the same world size. For a "
        "checkpoint that loads at any world size: shardtensor.save_checkpoint(dir, model, optimizer) on every rank; "
        "for full tensors: shardtensor.full_state_dict(model, rank0_only=True) on every rank, then torch.save on "
        "rank 0.", UserWarning, stacklevel=4)
