"""CPU offload of parameter shards: shards live in pinned host memory, copied to the GPU just before their gather.

``shard_module(model.cuda(), offload=CPUOffload(pin_memory=True))``:
  - each ShardedParam keeps its wrapper on the GPU (autograd sees GPU parameters and GPU gradients) while its
    ``_local`` shard moves to pinned CPU memory, allocated once (pinning is a syscall per
    allocation: never pin per step);
  - the offload is the Gatherer's ``ShardSource`` (``shardtensor.gather.ShardSource``): the shard about to be
    gathered is copied host to device on a side stream (``h2d_stream``: the copies overlap compute on the
    default stream), and the upcoming shards the Gatherer names are copied ahead within ``prefetch_bytes``;
  - gradients are reduced on the GPU and move into pinned host homes in a post-accumulate-grad hook, so the
    optimizer (``shardtensor.optim.CPUAdam``, or any optimizer whose state lives on the CPU) steps on the host.

On a machine without CUDA, parameters already live in host memory: "offloading" them would copy host to host
every step.  ``attach`` refuses with an error instead of doing that silently.

Status: run on one H100 (a 942M GPT in bf16: 4.8 GiB of GPU memory against 8.1 resident, 1.6x the step time;
``benchmarks/gpu_bench.py offload``).  Known limits: gradient accumulation across backwards without
``zero_grad`` reuses the host home (the second backward's AccumulateGrad adds on the GPU shard it no longer
has); optimizers must keep their state on the CPU (``CPUAdam``); gradient copies to the host are blocking.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch
from torch import nn

__all__ = ["CPUOffload"]


class CPUOffload:
    """Parameter shards in (pinned) host memory, copied to the compute device before their gathers.

    Implements the Gatherer's ``ShardSource`` protocol (``shard_for_gather``, ``upcoming``, ``on_step_begin``).

    Args:
        pin_memory: pin the host shards (and gradient homes) so copies are asynchronous.  When pinning fails
            (pinned memory is finite), pageable memory is used with a warning. (Default: True)
        prefetch_bytes: host-to-device copies issued ahead of the gathers, in bytes. (Default: 64 MiB)
    """

    def __init__(self, pin_memory: bool = True, prefetch_bytes: int = 64 << 20):
        if prefetch_bytes < 0:
            raise ValueError(f"CPUOffload: {prefetch_bytes=} must be >= 0")
        self.pin_memory = pin_memory
        self.prefetch_bytes = int(prefetch_bytes)
        self.h2d_stream: Any = None  # host-to-device copies of shards, off the compute stream
        self._device_copies: dict[int, tuple] = {}  # index -> (device shard, ready event, host version)
        self._grad_homes: dict[str, torch.Tensor] = {}
        self.h2d_copies = 0
        self.h2d_prefetched = 0

    # ------------------------------------------------------------------ attach (called by shard_module)
    def attach(self, module: nn.Module) -> None:
        """Move ``module``'s shards to host memory and route its gathers and gradients through this offload."""
        state = getattr(module, "_shardtensor", None)
        if state is None:
            raise ValueError("CPUOffload.attach: the module was not sharded; use shard_module(model, offload=...)")
        params = list(state.params.values())
        devices = {p.device.type for p in params}
        if not torch.cuda.is_available() or devices != {"cuda"}:
            raise ValueError(
                f"CPUOffload: the shards already live in host memory ({sorted(devices) or ['no parameters']} "
                f"parameters, {torch.cuda.is_available()=}); offloading them to the CPU would only copy host to "
                "host every step. Fix: drop offload=, or move the model to the GPU before shard_module."
            )
        self.h2d_stream = torch.cuda.Stream(device=params[0].device)
        state.gatherer.rehome_shards(self._host_copy)  # the wrappers stay on the GPU; only the shards move
        state.gatherer.shard_source = self
        for name, p in state.params.items():
            if p.requires_grad:  # registered now, so it runs before any optimizer's post-accumulate hooks
                state.hook_handles.append(p.register_post_accumulate_grad_hook(self._grad_to_host_hook(name)))

    def _host_copy(self, param: Any) -> torch.Tensor:
        local = param.to_local()
        host = None
        if self.pin_memory:
            try:
                host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
            except RuntimeError as e:  # pinned memory is finite: fall back, loudly, once
                warnings.warn(f"CPUOffload: pinning failed ({e}); using pageable host memory (slower copies)")
                self.pin_memory = False
        if host is None:
            host = torch.empty(local.shape, dtype=local.dtype)
        return host.copy_(local)

    # ------------------------------------------------------------------ the Gatherer's ShardSource
    def shard_for_gather(self, index: int, param: Any) -> torch.Tensor:
        """The device copy of ``param``'s shard (issued now unless prefetched and still current)."""
        entry = self._device_copies.pop(index, None)
        if entry is None or entry[2] != param.to_local()._version:
            entry = self._issue(param)
        else:
            self.h2d_prefetched += 1
        device_shard, ready, _ = entry
        torch.cuda.current_stream().wait_event(ready)  # the gather (on the compute stream) reads it
        device_shard.record_stream(torch.cuda.current_stream())
        return device_shard

    def upcoming(self, params: Sequence[tuple[int, Any]]) -> None:
        """Copy the next shards of the recorded order ahead, within ``prefetch_bytes``."""
        budget = self.prefetch_bytes - sum(t.numel() * t.element_size() for t, _, _ in self._device_copies.values())
        for index, param in params:
            if index in self._device_copies:
                continue
            host = param.to_local()
            nbytes = host.numel() * host.element_size()
            if nbytes > budget:
                break
            budget -= nbytes
            self._device_copies[index] = self._issue(param)

    def on_step_begin(self) -> None:
        pass  # prefetched copies stay valid across steps while their host shard's version is unchanged

    def _issue(self, param: Any) -> tuple:
        host = param.to_local()
        with torch.cuda.stream(self.h2d_stream):
            device_shard = host.to(param.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d_stream)
        self.h2d_copies += 1
        return device_shard, ready, host._version

    # ------------------------------------------------------------------ gradients
    def _grad_to_host_hook(self, name: str):
        """After AccumulateGrad: the reduced gradient shard (on the GPU) moves into its pinned host home, which
        is allocated once per parameter and reused (never pinned per step); the grad's wrapper stays on the GPU
        like its parameter's, so autograd's device checks hold."""

        def hook(p: Any) -> None:
            g = p.grad
            if g is None or not hasattr(g, "to_local") or g.to_local().device.type == "cpu":
                return
            local = g.to_local()
            home = self._grad_homes.get(name)
            if home is None or home.shape != local.shape or home.dtype != local.dtype:
                try:
                    home = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pin_memory)
                except RuntimeError:
                    home = torch.empty(local.shape, dtype=local.dtype)
                self._grad_homes[name] = home
            # Blocking: the optimizer's hooks that run next (CPUAdam's snapshot) read `home` on the CPU at once.
            home.copy_(local)
            g.rehome_(home)  # the optimizer steps host shards with host gradients

        return hook

    def synchronize(self) -> None:
        """Every gradient copy to the host is blocking (see the gradient hook), so there is nothing to wait for;
        kept so callers can mark where host gradients are read."""

    def stats(self) -> dict[str, Optional[int]]:
        return {"h2d_copies": self.h2d_copies, "h2d_prefetched": self.h2d_prefetched}
