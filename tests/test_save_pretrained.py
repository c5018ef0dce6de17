"""transformers' ``save_pretrained`` on a sharded model: without ``state_dict=`` it is named at once, on the
rank that calls it (rank 0 alone, as scripts often do), with the recipe; with the recipe, the saved model equals
the unsharded one."""

from __future__ import annotations

import os

import pytest
import torch

import shardtensor
from rank_pool import run_on_ranks

pytest.importorskip("transformers")


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))


def save_case(path: str, recipe) -> dict:
    """``recipe``: True (the full state dict), False (no state_dict=), "state_dict" (accelerate's habit:
    ``state_dict=model.state_dict()``)."""
    from transformers import GPT2LMHeadModel

    rank = torch.distributed.get_rank()
    model = shardtensor.shard_module(_gpt2())
    out = {}
    if recipe is True:
        state = shardtensor.full_state_dict(model, rank0_only=True)
    if rank == 0:
        try:
            if recipe == "state_dict":
                model.save_pretrained(path, state_dict=model.state_dict())
            else:
                model.save_pretrained(path, state_dict=state) if recipe else model.save_pretrained(path)
            out["message"] = "saved"
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            out["message"] = f"{type(exc).__name__}: {exc}"
        if recipe is True:
            loaded = GPT2LMHeadModel.from_pretrained(path)
            want = _gpt2().state_dict()
            out["equal"] = all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
        out["weights_written"] = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path)) \
            if os.path.isdir(path) else False
    torch.distributed.barrier()
    return out


@pytest.mark.parametrize("how", [False, "state_dict"])
def test_save_pretrained_without_the_full_state_dict_names_the_recipe(tmp_path, how):
    """It failed inside safetensors with "data pointer on an invalid python storage"; with accelerate's
    ``state_dict=model.state_dict()`` too (helper J), where the state dict is made before save_pretrained runs."""
    out = run_on_ranks(2, save_case, str(tmp_path / "m"), how)[0]
    assert "shardtensor.full_state_dict(model, rank0_only=True)" in out["message"], out
    assert not out["weights_written"], out


def test_save_pretrained_with_the_full_state_dict_equals_the_unsharded_model(tmp_path):
    out = run_on_ranks(2, save_case, str(tmp_path / "m"), True)[0]
    assert out["message"] == "saved" and out["equal"], out
