"""The benchmark's accounting (no ranks are spawned): what a figure in a results table means must not drift.

bench_peers.py / peers_report.py: memory is the worst rank's, wall time the mean of the ranks', CPU time the sum
over ranks; medians and min/max are over rounds; ratios are of medians; a peer that is not installed is skipped
with the command that installs it.  junit_to_json.py: gpu_suite.sh's test report counts what pytest reported.
"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_peers  # noqa: E402
import junit_to_json  # noqa: E402
import peers_report  # noqa: E402


def _rank(peak, step, cpu, **extra):
    return {"peak_mib": peak, "step_s": step, "cpu_s": cpu, **extra}


def _runs():
    # config -> rounds -> ranks
    return {
        "fsdp2": [[_rank(100, 1.0, 2.0), _rank(110, 1.2, 2.2)], [_rank(104, 1.4, 2.6), _rank(100, 1.6, 3.0)]],
        "deepspeed": [[_rank(200, 2.0, 4.0), _rank(190, 2.0, 4.0)], [_rank(210, 3.0, 5.0), _rank(200, 3.0, 5.0)]],
        "st-sequential": [[_rank(60, 1.0, 1.0), _rank(66, 1.0, 1.0)], [_rank(64, 2.0, 1.5), _rank(60, 2.0, 1.5)]],
    }


def test_per_round_takes_worst_peak_mean_wall_and_summed_cpu():
    rounds = peers_report.per_round(_runs())
    first = rounds["fsdp2"][0]
    assert first["peak_mib"] == 110  # worst rank
    assert first["step_s"] == pytest.approx(1.1)  # mean over ranks
    assert first["cpu_s"] == pytest.approx(4.2)  # sum over ranks


def test_summary_medians_spread_and_ratios_of_medians():
    summary = peers_report.summarize(peers_report.per_round(_runs()))
    fsdp2, seq = summary["fsdp2"], summary["st-sequential"]
    assert (fsdp2["step_s_min"], fsdp2["step_s_max"]) == pytest.approx((1.1, 1.5))
    assert fsdp2["step_s"] == pytest.approx(1.3)  # median of two rounds
    assert seq["peak_mib_x_fsdp2"] == pytest.approx(seq["peak_mib"] / fsdp2["peak_mib"])
    assert seq["cpu_s_x_deepspeed"] == pytest.approx(2.5 / 9.0)
    assert "peak_mib_x_ddp" not in seq  # no DDP ran: no ratio invented


def test_acceptance_marks_targets():
    summary = peers_report.summarize(peers_report.per_round(_runs()))
    summary["deepspeed-seq"] = dict(summary["deepspeed"])
    summary["st-sequential"]["peak_mib_x_deepspeed-seq"] = 0.7
    lines = peers_report.acceptance(summary)
    assert any("0.700x DeepSpeed" in line and "NOT MET" in line for line in lines)
    summary["st-sequential"]["peak_mib_x_deepspeed-seq"] = 0.5
    assert any("0.500x DeepSpeed" in line and line.endswith(": MET") for line in peers_report.acceptance(summary))


def test_missing_peer_is_skipped_with_install_command(monkeypatch):
    monkeypatch.setitem(bench_peers.OPTIONAL, "deepspeed", "surely_not_an_installed_module_xyz")
    monkeypatch.setitem(bench_peers.INSTALL_HINT, "surely_not_an_installed_module_xyz", "pip install it")
    skipped = bench_peers.missing_peers(["fsdp2", "deepspeed"])
    assert list(skipped) == ["deepspeed"] and "pip install it" in skipped["deepspeed"]
    monkeypatch.setitem(bench_peers.OPTIONAL, "deepspeed", "json")  # importable: runs
    assert bench_peers.missing_peers(["deepspeed"]) == {}


def test_rounds_rotate_so_no_config_always_runs_first():
    configs = ["a", "b", "c"]
    orders = [bench_peers.round_order(configs, i) for i in range(3)]
    assert [o[0] for o in orders] == ["a", "b", "c"]
    assert all(sorted(o) == configs for o in orders)


def test_junit_counts_and_missing_report(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="t" name="ok"/>'
                   '<testcase classname="t" name="bad"><failure message="boom"/></testcase>'
                   '<testcase classname="t" name="skip"><skipped message="no gpu"/></testcase>'
                   '</testsuite></testsuites>')
    r = junit_to_json.convert(str(xml))
    assert r["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1} and r["ok"] is False
    assert r["not_passed"][0] == {"test": "t::bad", "outcome": "failed", "message": "boom"}
    assert "killed by the time limit" in junit_to_json.convert(str(tmp_path / "absent.xml"))["error"]


def test_losses_compared_at_every_step_except_local_after_its_first():
    runs = {"fsdp2": [[{"losses": [2.0, 1.5]}]], "local": [[{"losses": [2.0, 1.9]}]],
            "st-sequential": [[{"losses": [2.0, 1.5 + 1e-7]}]]}
    assert peers_report.loss_agreement(runs)["max_abs_diff"] == pytest.approx(1e-7)
    runs["st-overlapped"] = [[{"losses": [2.0, 1.6]}]]  # a wrapper that trains something else: seen
    assert peers_report.loss_agreement(runs)["max_abs_diff"] == pytest.approx(0.1)


def test_bench_phases_times_each_phase_and_writes_its_table(tmp_path):
    """bench_phases.py's wiring at world 2 (the bare model, one timed step): every phase is timed and counted."""
    import bench_phases

    out = tmp_path / "phases.json"
    result = bench_phases.main(["--configs", "local", "--rounds", "1", "--steps", "1", "--out", str(out)])
    row = result["medians"]["local"]
    assert set(row) == set(bench_phases.PHASES)
    for wall, cpu, faults in row.values():
        assert wall > 0 and cpu > 0 and faults >= 0
    assert json.loads(out.read_text())["medians"] == json.loads(json.dumps(result["medians"]))
