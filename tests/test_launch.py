"""The launcher never hangs: a rank that raises or dies ends the launch with that rank's error, naming the rank.

In both cases the other rank is blocked in a collective with the failed one (it would wait for gloo's timeout,
30 minutes by default): the launcher must stop it instead of waiting, and the error must say which rank failed
and why.  The rank pool the tests use gets the same checks.
"""

import os
import signal

import pytest

import rank_pool
from rank_pool import run_on_ranks
from shardtensor.launch import RankFailed, spawn_ranks


def _fail_on_rank_1(rank: int, world: int, port: int, how: str) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 1:
        if how == "raise":
            raise ValueError("rank 1 fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: its peer never joins
    return rank


def _return_rank(rank: int, world: int, port: int) -> tuple:
    return rank, world


def test_spawn_ranks_returns_results_in_rank_order():
    assert spawn_ranks(_return_rank, 2) == [(0, 2), (1, 2)]


def _add_rank_in_place(rank: int, world: int, port: int, state: dict) -> float:
    import time

    seen = state["step"].item()
    state["step"] += rank + 1  # as an optimizer steps a state dict's counter it was given
    time.sleep(0.3)  # (the other rank has written by now, were the memory shared)
    return seen + 100 * (state["step"].item() - seen - rank - 1)


def test_each_rank_gets_its_own_copy_of_tensor_arguments():
    """``spawn_ranks(worker, 2, opt.state_dict())``: torch.multiprocessing shared the tensors' memory between the
    ranks and the caller, so a step counter of 2 stepped by both ranks read 4 where each expected 3, and the
    caller's changed too (helper 18)."""
    import torch

    state = {"step": torch.tensor(2.0)}
    assert spawn_ranks(_add_rank_in_place, 2, state) == [2.0, 2.0]
    assert state["step"].item() == 2.0


def test_a_rank_that_raises_ends_the_launch_with_its_traceback():
    with pytest.raises(RankFailed, match="rank 1 of 2 raised") as exc:
        spawn_ranks(_fail_on_rank_1, 2, "raise", timeout=120)
    assert exc.value.rank == 1
    assert "ValueError: rank 1 fails on purpose" in str(exc.value)


def test_a_killed_rank_ends_the_launch_naming_the_rank_and_signal():
    with pytest.raises(RankFailed, match="rank 1 of 2 died") as exc:
        spawn_ranks(_fail_on_rank_1, 2, "kill", timeout=120)
    assert exc.value.rank == 1
    assert "SIGKILL" in str(exc.value)


def _pool_fail_on_rank_1(how: str) -> int:
    import torch

    from shardtensor import _comm

    if _comm.rank() == 1:
        if how == "raise":
            raise ValueError("pool rank 1 fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    _comm.all_reduce(torch.ones(1))  # rank 0 blocks here
    return _comm.rank()


def _pool_rank() -> int:
    from shardtensor import _comm

    return _comm.rank()


def test_rank_pool_reports_a_killed_rank():
    with pytest.raises(RuntimeError, match="rank 1 died") as exc:
        run_on_ranks(2, _pool_fail_on_rank_1, "kill", timeout=120)
    assert "SIGKILL" in str(exc.value)
    assert run_on_ranks(2, _pool_rank) == [0, 1], "the next call gets a fresh pool"


def test_rank_pool_reports_a_raising_rank_while_its_peer_is_stuck(monkeypatch):
    monkeypatch.setattr(rank_pool, "FAILURE_GRACE_S", 2.0)
    with pytest.raises(AssertionError, match=r"ranks \[0\] gave no result") as exc:
        run_on_ranks(2, _pool_fail_on_rank_1, "raise", timeout=120)
    assert "ValueError: pool rank 1 fails on purpose" in str(exc.value)


def test_the_first_failure_is_named_not_its_echo_on_a_peer(tmp_path):
    """Rank 1 raises; rank 0's collective then fails with "Connection closed by peer", and torch may notice rank
    0 first (seen under load): the launcher names the rank that failed first."""
    from shardtensor.launch import _first_failure

    (tmp_path / "rank0.failed").write_text("200.5\nRuntimeError: Connection closed by peer\n")
    (tmp_path / "rank1.failed").write_text("200.1\nValueError: rank 1 fails on purpose\n")
    rank, text = _first_failure(str(tmp_path), 2, reported=0, text="torch's report of rank 0")
    assert rank == 1 and "ValueError: rank 1 fails on purpose" in text
    assert _first_failure(str(tmp_path / "none"), 2, reported=0, text="kept") == (0, "kept")
