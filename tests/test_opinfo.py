"""torch's OpInfo database as our conformance suite: a ShardedParam gives what the plain tensor gives.

Every OpInfo with a CPU float64 (else float32) sample runs with the sample's input as a ShardedParam in five
variants (see ``opinfo_harness``) at world 1 (in-process) and world 2 (one pair of gloo ranks for a whole batch
of cases; the sample is picked with an odd dim 0, so the last rank's shard is padded).  The default run takes a
stable hash-based subset of the (op, variant) pairs plus every op that broke before; the whole database runs with
``SHARDTENSOR_OPINFO_FULL=1`` (a few minutes at world 1, more at world 2).

A case fails the test when it is a mismatch, a crash, or a refusal of an out-of-place variant, unless it is
in ``XFAIL`` with its reason; an ``XFAIL`` entry that passes fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import collections
import json
import os
import zlib

import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest (pip install -e '.[test]')")

import opinfo_harness as harness  # noqa: E402
from rank_pool import _POOLS, run_on_ranks  # noqa: E402

FULL = os.environ.get("SHARDTENSOR_OPINFO_FULL") == "1"
SUBSET_PER_MILLE = 60  # about 6% of ~3,400 (op, variant) pairs
BATCH = 40

# (op key, variant or "*", world or 0 for both) -> why it is expected to fail.  Keep it short and reasoned.
XFAIL: dict[tuple[str, str, int], str] = {
    ("linalg.eigvals", "nan", 0): "on a tensor subclass linalg.eigvals decomposes into linalg.eig, which rejects NaN "
                                  "input (the plain kernel returns NaN eigenvalues); the error is torch's own",
    **{("nn.functional.rrelu", v, 0): "training-mode rrelu writes its random noise into empty_like(input), a "
                                       "shard-wise temporary of the parameter: a per-rank random write into shards, "
                                       "refused (the in-place variant's refusal is allowed anyway)"
       for v in ("forward", "no_grad", "backward", "nan")},
}

# Ops that broke before (issue 22 and the fixes after it): always in the default run.
ALWAYS = {
    "einsum", "__rmatmul__", "matmul", "tensordot", "linalg.tensorsolve", "nn.functional.normalize",
    "linalg.vector_norm", "linalg.norm", "dist", "copysign", "nn.functional.binary_cross_entropy", "isclose",
    "nn.functional.embedding", "max.reduction_no_dim", "min.reduction_no_dim", "amax", "amin", "sgn", "short",
    "masked.sum", "masked.amax", "masked.norm",
}


# Key prefixes expected to fail as a family.
XFAIL_PREFIX: dict[str, str] = {}


def _xfail_reason(key: str, variant: str, world: int) -> str | None:
    for prefix, reason in XFAIL_PREFIX.items():
        if key.startswith(prefix):
            return reason
    for k in ((key, variant, world), (key, "*", world), (key, variant, 0), (key, "*", 0)):
        if k in XFAIL:
            return XFAIL[k]
    return None


def _all_cases() -> list[tuple[str, str]]:
    return [(key, v) for key in sorted(harness.ops_by_key()) for v in harness.VARIANTS]


def selected_cases() -> list[tuple[str, str]]:
    if FULL:
        return _all_cases()
    return [(k, v) for k, v in _all_cases()
            if k in ALWAYS or zlib.crc32(f"{k}:{v}".encode()) % 1000 < SUBSET_PER_MILLE]


def _failed(key: str, outcome: str, variant: str) -> bool:
    """Refusals are allowed only for writes into the parameter: the in-place variant, or an op that is itself
    in-place (``resize_``)."""
    in_place = variant == "inplace" or key.split(".")[0].endswith("_")
    return outcome in ("mismatch", "crash") or (outcome == "refused" and not in_place)


def _run_world2(cases: list) -> list:
    """Batches of cases on one gloo pair; a batch that loses a rank or disagrees is re-run after the culprit."""
    results: list = []
    pending = list(cases)
    while pending:
        batch = pending[:BATCH]
        try:
            per_rank = run_on_ranks(2, harness.run_batch, batch, 2, timeout=600)
        except (RuntimeError, AssertionError) as exc:  # a rank died (a C++ abort) or hung
            if len(batch) == 1:
                results.append(("crash", f"rank died or hung: {str(exc)[:300]}"))
                pending = pending[1:]
                continue
            pool = _POOLS.get(2)
            if pool is not None:
                pool.kill()
            half = len(batch) // 2  # bisect towards the culprit
            sub = _run_world2(batch[:half])
            results.extend(sub)
            pending = pending[half:]
            continue
        done = 0
        for (a, b) in zip(*per_rank):
            if a[0] != b[0]:  # ranks disagree: later collectives may be paired wrongly; restart after this case
                results.append(("crash", f"ranks disagree: rank 0 {a}, rank 1 {b}"))
                done += 1
                pool = _POOLS.get(2)
                if pool is not None:
                    pool.kill()
                break
            results.append(a)
            done += 1
        pending = pending[done:]
    return results


def _check(cases: list, outcomes: list, world: int) -> None:
    counts: collections.Counter = collections.Counter()
    unexpected, fixed = [], []
    for (key, variant), (outcome, detail) in zip(cases, outcomes):
        reason = _xfail_reason(key, variant, world)
        failed = _failed(key, outcome, variant)
        counts["xfail" if failed and reason else outcome] += 1
        if failed and not reason:
            unexpected.append(f"{key} [{variant}] {outcome}: {detail}")
        elif reason and not failed and outcome != "skip":
            fixed.append(f"{key} [{variant}] passes now ({outcome}): remove it from XFAIL ({reason})")
    report = os.environ.get("SHARDTENSOR_OPINFO_REPORT")
    if report:
        with open(f"{report}.world{world}.json", "w") as f:
            json.dump({"counts": counts, "cases": [[k, v, o, d] for (k, v), (o, d) in zip(cases, outcomes)]}, f,
                      indent=0)
    assert not unexpected and not fixed, f"world {world}: {dict(counts)}\n" + "\n".join(unexpected + fixed)


@pytest.mark.parametrize("world", [1, 2])
def test_opinfo_conformance(world):
    cases = selected_cases()
    if world == 1:
        outcomes = harness.run_batch(cases, 1)
    else:
        outcomes = _run_world2(cases)
    _check(cases, outcomes, world)
