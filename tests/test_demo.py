"""The demo is the project's main job: it must run, train, and show less memory per rank than unsharded."""

from shardtensor import demo


def test_demo_trains_and_uses_less_memory_per_rank_than_unsharded(capsys):
    rows = demo.main(["--steps", "4", "--layers", "2"])
    ours = [r for r in rows if r["run"].startswith("shardtensor")]
    ddp = [r for r in rows if r["run"].startswith("unsharded")]
    assert len(ours) == len(ddp) == 2
    # Same math as DDP: sharding changes where parameters live, not what is computed.
    for a, b in zip(ours, ddp):
        assert abs(a["loss_last"] - b["loss_last"]) < 1e-3, (a, b)
    assert ours[0]["loss_last"] < ours[0]["loss_first"], "the loss falls"
    assert max(r["peak_mib"] for r in ours) < min(r["peak_mib"] for r in ddp), rows
    assert "peak memory per rank" in capsys.readouterr().out
