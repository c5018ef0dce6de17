"""torch's fake process group (one process plays rank 3 of 8, what ``bench_fake_world.py`` and the GPU suite use
for exact per-rank memory): ``shard_module`` and a training step run there, with the identity check on."""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = r"""
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
import shardtensor
from shardtensor.models import GPT, GPTConfig
torch.manual_seed(0)
model = shardtensor.shard_module(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)),
                                 gather=GATHER)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 64, (2, 8))
for _ in range(2):
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
wte = model.wte.weight
print(json.dumps({"rows": wte.to_local().shape[0], "full_rows": wte.shape[0],
                  "checks": shardtensor.identity_check_stats()["checks"]}))
"""


def _run(gather: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.replace("GATHER", repr(gather))], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_training_step_runs_as_one_rank_of_a_fake_world():
    for gather in ("sequential", "overlapped"):
        out = _run(gather)
        assert out["rows"] == -(-out["full_rows"] // 8), out  # this rank's 1/8 of the rows
        assert out["checks"] > 0, out  # the identity check ran (on the data group: no control group on fake)
