import pytest

from rank_pool import run_on_ranks


def _sum_of_ranks():
    import torch
    from shardtensor import _comm

    t = torch.tensor([float(_comm.rank())])
    _comm.all_reduce(t)
    return _comm.rank(), t.item()


def _boom():
    raise ValueError("boom on purpose")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_pool_runs_collectives_on_every_rank(world):
    results = run_on_ranks(world, _sum_of_ranks)
    assert [r for r, _ in results] == list(range(world))
    assert all(total == sum(range(world)) for _, total in results)


def test_pool_reports_worker_exceptions():
    with pytest.raises(AssertionError, match="boom on purpose"):
        run_on_ranks(2, _boom)
