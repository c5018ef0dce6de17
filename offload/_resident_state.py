"""What ``opt.state[p]`` holds for a parameter whose Adam moments ``NVMeOffload`` may swap out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtensor.optim.state_store import MOMENTS

if TYPE_CHECKING:
    from .nvme import NVMeOffload


class ResidentOnRead(dict):
    """A parameter's state in ``opt.state``, whose moments are made resident when read through it (an item, its
    items or values, a copy, its repr): a swapped-out moment keeps its shape over freed memory, and reading it
    (a logged norm, ``print(opt.state)``) read freed memory, and the process died with SIGSEGV.  Resident until
    the next step, or the next read of other units, needs the room."""

    def __init__(self, state: dict, offload: "NVMeOffload", key: int):
        super().__init__(state)
        self._offload, self._key = offload, key

    def _resident(self) -> None:
        if self._offload.has(self._key):
            with self._offload.use([self._key], dirty=False):
                pass

    def __getitem__(self, name):
        if name in MOMENTS:
            self._resident()
        return super().__getitem__(name)

    def get(self, name, default=None):
        return self[name] if name in self else default

    def items(self):
        self._resident()
        return super().items()

    def values(self):
        self._resident()
        return super().values()

    def copy(self) -> dict:
        self._resident()
        return dict(super().items())

    def __repr__(self) -> str:
        self._resident()
        return super().__repr__()

    def __reduce_ex__(self, protocol):  # a plain dict when pickled (weights_only loads know no class of ours)
        return dict, (self.copy(),)
