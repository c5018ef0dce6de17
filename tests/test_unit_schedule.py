"""When a unit's gathered parameters live (overlapped mode): the root unit's hold carried into its backward, and
buffers kept across the optimizer step on the CPU.  The numbers stay the unsharded model's whatever the loop
does between a forward and its backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rank_pool import run_on_ranks


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Blocks in a ModuleList and a root whose own parameters (embedding, norm, head) fit in one block: the
    default units are the blocks and the root."""

    def __init__(self, dim: int = 8, layers: int = 3, vocab: int = 11):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), targets.flatten())


def _batch(gen: torch.Generator, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, vocab, (2, 5), generator=gen), torch.randint(0, vocab, (2, 5), generator=gen)


def _step(model, batches: list, habit: str, scale: float) -> None:
    """One step's forwards and backwards as ``habit`` writes them; ``batches``: two per rank (this rank's, or
    every rank's in turn for the unsharded model, whose loss is divided by the world: the ranks' mean)."""
    if habit == "forward_without_backward":  # an evaluation with gradients on, its loss dropped
        model(*batches[0][0])
    if habit in ("two_forwards_one_backward", "older_forward_first"):
        first = sum(model(*b[0]) for b in batches) * scale
        second = sum(model(*b[1]) for b in batches) * scale
        if habit == "two_forwards_one_backward":
            (first + second).backward()
        else:
            first.backward()
            second.backward()
        return
    loss = sum(model(*b[0]) for b in batches) * scale
    if habit == "retain_graph":
        loss.backward(retain_graph=True)
    loss.backward()
    if habit == "no_grad_eval_after":
        with torch.no_grad():
            model(*batches[0][1])


def train_like_the_unsharded_model(mode: str, habit: str) -> float:
    import torch.distributed as dist

    import shardtensor

    torch.manual_seed(0)
    reference = Net().double()
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = [(_batch(gen), _batch(gen)) for _ in range(world)]
        _step(model, [batches[rank]], habit, 1.0)
        opt.step()
        opt.zero_grad()
        _step(reference, batches, habit, 1.0 / world)
        ref_opt.step()
        ref_opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items())


HABITS = ["step", "forward_without_backward", "two_forwards_one_backward", "older_forward_first", "retain_graph",
          "no_grad_eval_after"]


@pytest.mark.parametrize("mode", ["overlapped", "sequential"])
@pytest.mark.parametrize("habit", HABITS)
def test_the_root_units_kept_hold_trains_like_the_unsharded_model(mode, habit):
    """The root unit's forward hold is its backward's only for the backward of that same forward; a forward
    no backward follows, a second forward before the backward, the older forward's backward first, a backward
    run twice and an evaluation after the step all give the unsharded model's parameters."""
    for diff in run_on_ranks(2, train_like_the_unsharded_model, mode, habit):
        assert diff < 1e-12, diff


def gathers_per_unit(habit: str) -> dict:
    """Each unit's gathers in the third step (the first two record and warm up), and the root unit's holds after
    it."""
    import shardtensor
    from shardtensor import _unit

    torch.manual_seed(0)
    model = shardtensor.shard_module(Net().double(), gather="overlapped")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    counts: dict = {}
    start = _unit._Unit._start

    def counted(unit, *, async_op):
        counts[unit.name] = counts.get(unit.name, 0) + 1
        return start(unit, async_op=async_op)

    for step in range(3):
        if step == 2:
            _unit._Unit._start = counted
        try:
            _step(model, [(_batch(gen), _batch(gen))], habit, 1.0)
            opt.step()
            opt.zero_grad()
        finally:
            _unit._Unit._start = start
    return {"counts": counts, "root_holds": model._shardtensor_unit.holds}


def test_the_root_unit_is_gathered_once_per_step():
    """Its backward takes the hold of its forward (FSDP2 does not reshard its root either): one gather a step
    for the root, two for each block; a forward whose loss is dropped releases its hold at the next forward,
    where the root is gathered again."""
    for out in run_on_ranks(2, gathers_per_unit, "step"):
        assert out == {"counts": {"Net": 1, "blocks.0": 2, "blocks.1": 2, "blocks.2": 2}, "root_holds": 0}, out
    for out in run_on_ranks(2, gathers_per_unit, "forward_without_backward"):
        assert out["counts"]["Net"] == 2 and out["root_holds"] == 0, out


def fresh_buffers_per_phase(device_steps: int = 4) -> dict:
    """Full tensors the unit pool had to allocate in the forward and in the backward of the last step, and the
    bytes it keeps over the optimizer step against one block's gathered bytes."""
    import shardtensor

    torch.manual_seed(0)
    model = shardtensor.shard_module(Net(dim=256, layers=3, vocab=64), gather="overlapped")  # 256 x 512 weights
    pool = model.blocks[0]._shardtensor_unit.pool
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    out = {}
    for _ in range(device_steps):
        x, y = _batch(gen, 64)
        before = pool.fresh
        loss = model(x, y)
        out["forward"], before = pool.fresh - before, pool.fresh
        loss.backward()
        out["backward"] = pool.fresh - before
        out["kept_bytes"] = sum(t.numel() * t.element_size() for t in pool.free)
        opt.step()
        opt.zero_grad()
    out["block_bytes"] = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    return out


def test_buffers_freed_at_the_end_of_a_backward_serve_the_next_forward():
    """CPU, overlapped: the backward's last units leave their gathered buffers to the next forward, which
    allocates none (every step used to start with fresh ones for the root and the first two blocks); the
    backward allocates one block's (its second unit, gathered while the first computes); what waits through
    the optimizer step is two blocks' large weights at most (the gathers that take them a moment later)."""
    for out in run_on_ranks(2, fresh_buffers_per_phase):
        assert out["forward"] == 0, out
        assert out["backward"] == 2, out  # fc1.weight and fc2.weight of one block
        assert 0 < out["kept_bytes"] <= 2 * out["block_bytes"], out
