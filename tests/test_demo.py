"""The demo is the project's main job: it must run, train like DDP, and keep only shards on each rank."""

import pytest

from shardtensor import demo


def test_demo_trains_like_ddp_and_each_rank_stores_only_its_shards(capsys):
    rows = demo.main(["--steps", "4", "--layers", "2"])
    ours = [r for r in rows if r["run"].startswith("shardtensor")]
    ddp = [r for r in rows if r["run"].startswith("unsharded")]
    assert [r["rank"] for r in ours] == [r["rank"] for r in ddp] == [0, 1]
    # Same math as DDP: sharding changes where parameters live, not what is computed.
    for a, b in zip(ours, ddp):
        assert abs(a["loss_last"] - b["loss_last"]) < 1e-3, (a, b)
    assert ours[0]["loss_last"] < ours[0]["loss_first"], "the loss falls"
    # Memory, as behaviour rather than a measured RSS: DDP keeps every element on every rank; a sharded rank keeps
    # its rows only (about half at world 2; dim-0 padding adds at most one row per parameter).
    assert all(r["local_param_elements"] == r["params"] for r in ddp)
    assert all(r["local_param_elements"] <= 0.55 * r["params"] for r in ours), ours
    assert sum(r["local_param_elements"] for r in ours) >= ours[0]["params"], "every element is held somewhere"
    assert "peak memory per rank" in capsys.readouterr().out


def test_demo_exits_with_the_failing_ranks_error():
    # n_embd 6 with 4 heads cannot be split into heads: every rank raises in its first forward.  The demo must end
    # (not hang) with exit code 1 and the rank's traceback, not leave the parent waiting on the ranks.
    with pytest.raises(SystemExit) as exc:
        demo.main(["--steps", "1", "--layers", "1", "--dim", "6", "--no-baseline"])
    message = str(exc.value.code)
    assert message.startswith("error: ") and "raised" in message and "rank " in message, message
    assert "Traceback" in message and "RuntimeError" in message, message
