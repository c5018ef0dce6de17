"""Identity records through shared memory: each rank's record reaches every rank whole, in rank order; a slot
half written or of another exchange is never taken; a missing rank times out with a named error; the mailbox is
used only where every rank maps the same file, and nothing is left in /dev/shm."""

from __future__ import annotations

import datetime
import mmap
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rank_pool import run_on_ranks
from shardtensor import _comm_mailbox as mb


def _boxes(world: int) -> list:
    """``world`` mailboxes over one anonymous shared mapping, as ``world`` processes would have them."""
    mapping = mmap.mmap(-1, mb._PREAMBLE + world * mb._SLOTS * mb._SLOT_BYTES)
    return [mb.Mailbox(mapping, rank, world) for rank in range(world)]


@settings(max_examples=30, deadline=None)
@given(world=st.integers(1, 4), rounds=st.integers(1, 2 * mb._SLOTS + 1), data=st.data())
def test_every_rank_receives_every_record_in_rank_order(world, rounds, data):
    boxes = _boxes(world)
    for _ in range(rounds):  # more rounds than slots: the ring wraps
        nbytes = data.draw(st.integers(1, mb.CAPACITY))
        rows = [torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=nbytes, max_size=nbytes)),
                             dtype=torch.uint8) for _ in range(world)]
        outs = [torch.empty(world * nbytes, dtype=torch.uint8) for _ in range(world)]
        works = [box.exchange(out, row) for box, out, row in zip(boxes, outs, rows)]
        for work in works:
            assert work.wait(datetime.timedelta(seconds=5))
        for out in outs:
            assert torch.equal(out, torch.cat(rows))


def test_a_half_written_or_stale_slot_is_not_taken():
    writer, reader = _boxes(2)
    record = torch.arange(7, dtype=torch.int64)
    work = reader.exchange(torch.empty(14, dtype=torch.int64), record)
    assert not work.is_completed()  # rank 0 has written nothing yet
    writer.exchange(torch.empty(14, dtype=torch.int64), record + 10)
    offset = writer._offset(0, 1) + mb._HEADER.size
    writer.mapping[offset] ^= 0xFF  # a payload byte changed after the header: a torn write, as a reader may see it
    assert not work.is_completed()
    writer.mapping[offset] ^= 0xFF
    assert work.is_completed() and work.wait()
    assert torch.equal(work.out, torch.cat([record + 10, record]))
    for _ in range(mb._SLOTS - 1):  # exchanges 2 to _SLOTS, both ranks
        works = [box.exchange(torch.empty(14, dtype=torch.int64), record) for box in (writer, reader)]
        assert all(w.wait() for w in works)
    late = reader.exchange(torch.empty(14, dtype=torch.int64), record)  # rank 0's slot for it holds exchange 1
    assert not late.is_completed()


def test_a_rank_that_never_writes_times_out_naming_the_exchange():
    _, reader = _boxes(2)
    work = reader.exchange(torch.empty(14, dtype=torch.int64), torch.zeros(7, dtype=torch.int64))
    with pytest.raises(TimeoutError, match=r"timed out after 0.05 s waiting for exchange #1 of group rank\(s\) \[0\]"):
        work.wait(datetime.timedelta(seconds=0.05))


def transport_of_a_new_group(refuse_on: int) -> dict:
    """The transport a new group's identity records take when rank ``refuse_on`` (-1: none) sets
    SHARDTENSOR_SHM_RECORDS=0, and whether its files were removed; one collective checks the records flow."""
    import torch.distributed as dist

    from shardtensor import _comm, _comm_divergence

    before = set(os.listdir("/dev/shm"))
    group = dist.new_group([0, 1])
    if dist.get_rank() == refuse_on:
        os.environ["SHARDTENSOR_SHM_RECORDS"] = "0"
    try:
        for _ in range(3):  # the first exchange goes through the store and builds the transport
            t = torch.full((2,), float(dist.get_rank()))
            _comm.all_reduce(t, group)
    finally:
        os.environ.pop("SHARDTENSOR_SHM_RECORDS", None)
    carrier = _comm_divergence.record_exchange(group).__self__
    out = {"mailbox": isinstance(carrier, mb.Mailbox), "control": isinstance(carrier, dist.ProcessGroupGloo),
           "sum": t.tolist(),
           "left_in_shm": sorted(set(os.listdir("/dev/shm")) - before)}
    dist.barrier()
    dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("refuse_on", [-1, 1])
def test_the_mailbox_is_used_only_where_every_rank_maps_it(refuse_on):
    for out in run_on_ranks(2, transport_of_a_new_group, refuse_on):
        assert out["sum"] == [1.0, 1.0] and out["left_in_shm"] == [], out
        assert (out["mailbox"], out["control"]) == ((True, False) if refuse_on == -1 else (False, True)), out


def test_a_shared_file_has_every_page_before_use_or_is_not_made(monkeypatch):
    """A page of a sparse file first written when /dev/shm is full (Docker's default is 64 MB) kills its writer
    with SIGBUS: every page is allocated when the file is made, and where that fails there is no file (gloo)."""
    mapping, path = mb._create(1 << 20)
    try:
        assert os.stat(path).st_blocks * 512 >= 1 << 20
    finally:
        mapping.close()
        os.unlink(path)
    before = set(os.listdir(mb._SHM_DIR))
    assert mb._create(mb._free_bytes() + (1 << 30)) == (None, "")  # more than /dev/shm holds: not tried
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    assert mb._create(1 << 20) == (None, "")
    assert set(os.listdir(mb._SHM_DIR)) == before
