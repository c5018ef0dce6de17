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


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.head = inner, nn.Linear(2, 2)


def wrapper_case(only_rank: int) -> dict:
    """A plain wrapper around the sharded root; rank ``only_rank``'s dict has a DDP checkpoint's keys."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = _Wrapper(shardtensor.shard_module(_build(0)))
    before = {k: v.clone() for k, v in shardtensor.full_state_dict(model.inner).items()}
    source = _Wrapper(_build(1)).state_dict()
    given = {f"module.{k}": v for k, v in source.items()} if rank == only_rank else source
    try:
        model.load_state_dict(given)
        outcome = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        outcome = f"{type(exc).__name__}: {exc}"
    after = shardtensor.full_state_dict(model.inner)
    return {"outcome": outcome, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def test_a_strict_load_through_a_wrapper_changes_nothing_on_any_rank():
    """The key check ran only for a load called on the sharded root: through a wrapper, rank 1 raised torch's
    error while rank 0 met a DivergenceError about digests, and the ranks stayed out of step."""
    results = run_on_ranks(2, wrapper_case, 1)
    assert '"inner.0.weight"' in results[1]["outcome"] and "another rank refused it" in results[0]["outcome"], results
    assert all(r["outcome"].startswith("RuntimeError") and r["unchanged"] for r in results), results


class _Forgiving(nn.Module):
    """A load post-hook that forgives missing keys (torch documents that strict honours the edit)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_load_state_dict_post_hook(lambda module, keys: keys.missing_keys.clear())


class _StateOnly(nn.Linear):
    """``get_extra_state`` without ``set_extra_state``: torch neither wants nor loads the key."""

    def get_extra_state(self):
        return {"note": 1}


def _none_child() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_module("c", None)
    return model


@pytest.mark.parametrize("build,edit", [
    (_Forgiving, lambda sd: {k: v for k, v in sd.items() if not k.startswith("b.")}),
    (lambda: _StateOnly(4, 4), lambda sd: {k: v for k, v in sd.items() if k != "_extra_state"}),
    (_none_child, lambda sd: {**sd, "c.weight": torch.zeros(4, 4)}),
])
def test_strict_loads_torch_takes_are_taken(build, edit):
    """Refused by the first version of the key check; torch loads them."""
    torch.manual_seed(0)
    given = edit(build().state_dict())
    plain, model = build(), shardtensor.shard_module(build())
    want = plain.load_state_dict(given)
    got = model.load_state_dict(given)
    assert (sorted(got.missing_keys), sorted(got.unexpected_keys)) == (sorted(want.missing_keys),
                                                                       sorted(want.unexpected_keys))


def rank0_only_dict_case(how: str) -> dict:
    """``strict=False`` with the full dict on rank 0 only (``full_state_dict(..., rank0_only=True)``, FSDP's
    load-on-rank-0 habit): rank 0 went on to the digest exchange while rank 1 returned as if loaded, and both
    met a DivergenceError at the next gather."""
    rank = torch.distributed.get_rank()
    model = shardtensor.shard_module(_build(0))
    before = shardtensor.full_state_dict(model)
    given = shardtensor.full_state_dict(shardtensor.shard_module(_build(1)), rank0_only=True)
    try:
        if how == "module":
            model.load_state_dict(given, strict=False)
        else:
            shardtensor.load_full_state_dict(model, given, strict=False)
        outcome = "loaded"
    except Exception as exc:  # noqa: BLE001 - the test reads its type and text
        outcome = f"{type(exc).__name__}: {exc}"
    after = shardtensor.full_state_dict(model)
    model(torch.randn(3, 4)).sum().backward()  # every rank still in step
    return {"outcome": outcome, "rank": rank,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


@pytest.mark.parametrize("how", ["module", "load_full_state_dict"])
def test_a_full_dict_on_rank_0_only_is_refused_on_every_rank(how):
    for r in run_on_ranks(2, rank0_only_dict_case, how):
        assert r["outcome"].startswith("ValueError") and "different keys" in r["outcome"] or \
            "holds" in r["outcome"] and "another rank's" in r["outcome"], r
        assert "Fix:" in r["outcome"] and r["unchanged"], r


def snapshot_case() -> dict:
    """A full state dict kept as a snapshot (best model, EMA) while training goes on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    model.register_parameter("scale", nn.Parameter(torch.tensor(1.5)))  # 0-d: kept whole
    shardtensor.shard_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshot = shardtensor.full_state_dict(model)
    kept = {k: v.clone() for k, v in snapshot.items()}
    for _ in range(2):
        (model(torch.randn(8, 4)).sum() * model.scale).backward()
        opt.step()
        opt.zero_grad()
    now = shardtensor.full_state_dict(model)
    return {"moved": sorted(k for k in kept if not torch.equal(snapshot[k], kept[k])),
            "trained": sorted(k for k in kept if not torch.equal(now[k], kept[k]))}


def test_a_full_state_dict_is_a_snapshot_of_every_entry():
    # The sharded entries were copies but the kept-whole ones (BatchNorm's statistics, 0-d parameters) the live
    # tensors: a snapshot moved with training for those keys only.
    for r in run_on_ranks(2, snapshot_case):
        assert r["moved"] == [], r
        assert {"1.running_mean", "1.running_var", "scale", "0.weight"} <= set(r["trained"]), r
