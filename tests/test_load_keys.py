"""``model.load_state_dict`` with keys torch reports under ``strict=True`` (missing, unexpected, renamed with a
wrapper's ``module.`` prefix): torch copies every other tensor, then raises, leaving a half-loaded model; a
sharded model's load refuses before the first copy, on every rank, with torch's message and error type, also
where only one rank's dict is wrong.  ``strict=False`` keeps torch's meaning."""

from __future__ import annotations

import pytest

import torch
from torch import nn

import shardtensor
from rank_pool import run_on_ranks


def _build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2), nn.BatchNorm1d(2))


def _edit(sd: dict, how: str) -> dict:
    if how == "missing":
        return {k: v for k, v in sd.items() if k != "2.weight"}
    if how == "unexpected":
        return {**sd, "head.weight": torch.zeros(2, 6)}
    if how == "renamed":  # a DDP checkpoint's keys
        return {f"module.{k}": v for k, v in sd.items()}
    return sd


def load_case(how: str, only_rank: int, strict: bool) -> dict:
    rank = torch.distributed.get_rank()
    model = shardtensor.shard_module(_build(0))
    before = {k: v.clone() for k, v in shardtensor.full_state_dict(model).items()}
    source = _build(1).state_dict()
    given = _edit(source, how) if only_rank in (-1, rank) else source
    try:
        result = model.load_state_dict(given, strict=strict)
        outcome = f"loaded: missing {list(result.missing_keys)}, unexpected {list(result.unexpected_keys)}"
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        outcome = f"{type(exc).__name__}: {exc}"
    after = shardtensor.full_state_dict(model)
    return {"outcome": outcome,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "took_source": all(torch.equal(after[k], source[k]) for k in after if k in given)}


@pytest.mark.parametrize("how,only_rank", [("missing", -1), ("unexpected", -1), ("renamed", -1), ("renamed", 1),
                                           ("missing", 0)])
def test_a_strict_load_torch_would_refuse_changes_nothing_on_any_rank(how, only_rank):
    """Every rank raised torch's RuntimeError only after copying the rest (and where only one rank's dict was
    renamed, that rank raised at once and the other waited in the digest exchange)."""
    results = run_on_ranks(2, load_case, how, only_rank, True)
    key = {"missing": '"2.weight"', "unexpected": '"head.weight"', "renamed": '"module.0.weight"'}[how]
    for rank, r in enumerate(results):
        assert r["outcome"].startswith("RuntimeError"), r
        assert r["unchanged"], r
        if only_rank in (-1, rank):
            assert key in r["outcome"] and "Nothing was copied on any rank" in r["outcome"], r
        else:
            assert "another rank refused it" in r["outcome"], r


def test_a_non_strict_load_with_missing_keys_loads_the_rest_as_torch_does():
    for r in run_on_ranks(2, load_case, "missing", -1, False):
        assert r["outcome"] == "loaded: missing ['2.weight'], unexpected []", r
        assert r["took_source"] and not r["unchanged"], r
