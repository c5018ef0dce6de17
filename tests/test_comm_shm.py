"""Unit collectives through shared memory: every rank ends with gloo's bits (a gather's rows, a reduce-scatter's
sums in gloo's order) whatever the order the ranks post and poll in; a slot is never written before its readers
are done, and where one is not, the collective goes over gloo on every rank instead of waiting; training through
it equals training over gloo, bit for bit."""

from __future__ import annotations

import datetime
import mmap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rank_pool import run_on_ranks
from shardtensor import _comm_shm as shm


def _channels(world: int, capacity: int) -> list:
    """``world`` channels over one anonymous shared mapping, as ``world`` processes would have them."""
    capacity = -(-capacity // shm._PAGE) * shm._PAGE
    mapping = mmap.mmap(-1, shm.Channel.size_for(world, capacity))
    return [shm.Channel(mapping, rank, world, capacity) for rank in range(world)]


def _buffers(world: int, shapes: list, dtype: torch.dtype, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((world * rows, *rest), generator=g, dtype=torch.float64).to(dtype) for rows, rest in shapes]


def _gloo_sum(buffers_by_rank: list, me: int, world: int) -> list:
    """What ``_comm_rows.reduce_scatter_in_place`` leaves in rank ``me``'s rows: its own, then peer me-1, me-2..."""
    out = []
    for i, buffer in enumerate(buffers_by_rank[me]):
        rows = buffer.shape[0] // world
        own = buffer[me * rows:(me + 1) * rows].clone()
        for k in range(1, world):
            peer = buffers_by_rank[(me - k) % world][i]
            own.add_(peer[me * rows:(me + 1) * rows])
        out.append(own)
    return out


shapes = st.lists(st.tuples(st.integers(1, 5), st.sampled_from([(), (3,), (2, 7)])), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(2, 4), shapes=shapes, dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       rounds=st.integers(1, 2 * shm.SLOTS + 1), data=st.data())
def test_gathers_and_reductions_give_every_rank_gloos_bits(world, shapes, dtype, rounds, data):
    channels = _channels(world, 1 << 14)
    for r in range(rounds):
        gather = data.draw(st.booleans())
        inputs = [_buffers(world, shapes, dtype, seed=100 * r + rank) for rank in range(world)]
        expected = [_gloo_sum(inputs, rank, world) for rank in range(world)] if not gather else None
        buffers = [[b.clone() for b in bufs] for bufs in inputs]
        order = data.draw(st.permutations(range(world)))  # ranks post in any order...
        works = {}
        for rank in order:
            channels[rank].progress()
            assert channels[rank].next_slot_free()
            if gather:
                works[rank] = channels[rank].gather(buffers[rank])
            else:
                works[rank] = channels[rank].reduce_scatter(buffers[rank])[1]
        for rank in data.draw(st.permutations(range(world))):  # ...and wait in any order
            assert works[rank].wait(datetime.timedelta(seconds=5))
        for rank in range(world):
            for i, buffer in enumerate(buffers[rank]):
                rows = buffer.shape[0] // world
                if gather:  # every rank's rows are the writers' own
                    want = torch.cat([inputs[w][i][w * rows:(w + 1) * rows] for w in range(world)])
                    assert torch.equal(buffer, want)
                else:
                    assert torch.equal(buffer[rank * rows:(rank + 1) * rows], expected[rank][i])


def test_a_slot_is_never_written_before_its_readers_are_done():
    a, b = _channels(2, 4096)
    x = [torch.arange(4.0).reshape(2, 2)]
    for _ in range(shm.SLOTS):  # rank 0 posts into every slot; rank 1 reads none of them
        assert a.next_slot_free()
        a.gather([t.clone() for t in x])
    assert not a.next_slot_free()
    with pytest.raises(AssertionError, match="before its readers were done"):
        a.gather(x)
    works = [b.gather([t.clone() for t in x]) for _ in range(shm.SLOTS)]
    b.progress()  # rank 1 takes what rank 0 posted for its pending gathers: rank 0's slots are free again
    assert all(w.is_completed() for w in works) and a.next_slot_free()


def gathers_past_a_peer_that_reads_nothing() -> dict:
    """Rank 1 leaves three gathers unwaited and takes nothing early (as a rank busy elsewhere), so rank 0's slots
    stay unread: the fourth gather goes over gloo on both ranks (rank 0 votes no in the identity check), and every
    gather still gives every rank's rows."""
    import torch.distributed as dist

    from shardtensor import _comm_rows

    group, me = dist.new_group([0, 1]), dist.get_rank()
    channel = shm.Channel.open(group, 4096, 30.0)
    if me == 1:
        channel.progress = lambda: None
    buffers = [torch.full((2, 3), float(me)) for _ in range(shm.SLOTS + 1)]
    works = []
    for i, buffer in enumerate(buffers):
        buffer[me] = 10.0 * i + me
        works.append(_comm_rows.all_gather_in_place([buffer], group, async_op=True, channel=channel))
        if me == 0:
            works[-1].wait()
    for work in works:
        work.wait()
    out = {"through_channel": channel.count, "rows": [b.tolist() for b in buffers]}
    dist.barrier()
    dist.destroy_process_group(group)
    return out


def test_a_collective_goes_over_gloo_on_every_rank_where_any_slot_is_still_unread():
    for out in run_on_ranks(2, gathers_past_a_peer_that_reads_nothing):
        assert out["through_channel"] == shm.SLOTS, out
        assert out["rows"] == [[[10.0 * i] * 3, [10.0 * i + 1] * 3] for i in range(shm.SLOTS + 1)], out


def test_a_peer_that_never_posts_times_out_naming_the_collective():
    a, _ = _channels(2, 4096)
    work = a.gather([torch.zeros(2, 3)])
    with pytest.raises(TimeoutError, match=r"timed out after 0.05 s waiting for collective #1 of group rank\(s\) \[1\]"):
        work.wait(datetime.timedelta(seconds=0.05))


def train_over(transport: str) -> dict:
    """Three overlapped AdamW steps of a GPT through shared memory or over gloo; the parameters, and whether a
    channel carried the units' collectives."""
    import os

    import shardtensor
    from shardtensor.models import GPT, GPTConfig

    os.environ["SHARDTENSOR_SHM_COLLECTIVES"] = "1" if transport == "shm" else "0"
    try:
        torch.manual_seed(0)
        model = shardtensor.shard_module(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2,
                                                       n_embd=32)), gather="overlapped")
    finally:
        del os.environ["SHARDTENSOR_SHM_COLLECTIVES"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randint(0, 64, (2, 8), generator=gen)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    channel = model.blocks[0]._shardtensor_unit.channel
    return {"channel": channel is not None, "state": shardtensor.full_state_dict(model)}


@pytest.mark.parametrize("world", [2, 4])
def test_training_through_shared_memory_equals_training_over_gloo_bit_for_bit(world):
    for shm_out, gloo_out in zip(run_on_ranks(world, train_over, "shm"), run_on_ranks(world, train_over, "gloo")):
        assert shm_out["channel"] and not gloo_out["channel"]
        for name, value in gloo_out["state"].items():
            assert torch.equal(shm_out["state"][name], value), name
