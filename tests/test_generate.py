"""transformers' ``generate`` on a sharded model: every rank must run the same forwards, so ranks whose
sequences end at different steps need ``synced_gpus=True`` (as under DeepSpeed ZeRO-3 and FSDP); without it the
divergence is named with that fix, and with it the tokens equal the unsharded model's."""

from __future__ import annotations

import pytest

import torch

import shardtensor
from rank_pool import run_on_ranks

pytest.importorskip("transformers")


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def generate_case(synced: bool, mode: str = "overlapped", then: str = "full_state_dict") -> dict:
    rank = torch.distributed.get_rank()
    plain, model = _gpt2(), shardtensor.shard_module(_gpt2(), gather=mode)
    prompt = torch.tensor([[1 + rank, 2, 3]])
    new_tokens = 2 + 2 * rank  # each rank's own stopping point
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, synced_gpus=synced)
    try:
        with torch.no_grad():
            got = model.generate(prompt, **kwargs)
            if then == "full_state_dict":  # the rank that finished first goes on to something else
                shardtensor.full_state_dict(model)
            else:  # an evaluation
                model(prompt)
            torch.distributed.barrier()
        return {"equal": torch.equal(got, plain.generate(prompt, max_new_tokens=new_tokens, do_sample=False))}
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"message": f"{type(exc).__name__}: {exc}"}


@pytest.mark.parametrize("mode,then", [("overlapped", "full_state_dict"), ("sequential", "full_state_dict"),
                                       ("overlapped", "evaluation"), ("sequential", "evaluation")])
def test_generate_with_different_lengths_per_rank_names_synced_gpus(mode, then):
    """Helper J: in sequential mode (and for an evaluation in either) the finished rank's next gathers matched its
    peer's inside generate() (the same parameters in the same order) and exchanged data unnoticed; it then waited
    at a barrier until the collective timeout (600 s), no fix named.  A call to generate() is in the identity
    record now, so the first collective after the ranks part raises on both."""
    results = run_on_ranks(2, generate_case, False, mode, then, timeout=120)
    assert all("DivergenceError" in r.get("message", "") for r in results), results
    assert "synced_gpus=True" in results[1]["message"], results  # the rank still generating
    # and the rank that finished first (helper C: its error came at its next collective, without the fix)
    assert "synced_gpus=True" in results[0]["message"], results


def test_generate_with_synced_gpus_equals_the_unsharded_model():
    for r in run_on_ranks(2, generate_case, True):
        assert r.get("equal") is True, r
