"""Does 4-bit gradient compression with error feedback train as well as fp32, on ~7.5x fewer bytes?

A small GPT (``shardtensor.models``) is sharded with ``shard_module(model, reducer=...)`` on W gloo CPU ranks and
trained with AdamW on Python standard-library source text (characters), each rank on its own batches, once per gradient reducer:

- ``fp32``: exact reduce-scatter in fp32 (``ExactReducer``), the reference;
- ``bf16``: exact reduce-scatter in bf16 (``ExactReducer(reduce_dtype=torch.bfloat16)``), the usual halving;
- ``int4+ef``: ``CompressedReducer()`` (4 bits, groups of 128, LoCo error feedback, beta 0.8);
- ``int4``: ``CompressedReducer(error_feedback=False)``, plain 4 bits;
- ``fp32@seed1``: fp32 again on other batches: how far two exact runs land apart (the noise floor of the gaps).

Every run starts from the same weights and sees the same batches.  Wire bytes are measured from the tensors the
gradient collectives are handed (``_comm.reduce_scatter_rows`` and ``_comm.all_to_all`` are wrapped with a
counter), per step, per rank; for int4 they are checked against ``CompressedReducer.bytes_sent``.  Final loss =
the mean over the last 10% of steps of the rank-averaged training loss, and the loss on held-out batches.

    python benchmarks/bench_compression.py                      # 300 steps, 2 ranks, writes results/compression.*
    python benchmarks/bench_compression.py --steps 50 --out /tmp/quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch

from shardtensor.launch import run_or_exit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

REDUCERS = ("fp32", "bf16", "int4+ef", "int4", "fp32@seed1")


def _make_reducer(name: str):
    from shardtensor import ExactReducer
    from shardtensor.optim import CompressedReducer

    name = name.split("@")[0]
    return {
        "fp32": lambda: ExactReducer(),
        "bf16": lambda: ExactReducer(reduce_dtype=torch.bfloat16),
        "int4+ef": lambda: CompressedReducer(),
        "int4": lambda: CompressedReducer(error_feedback=False),
    }[name]()


class _WireCounter:
    """Counts the bytes handed to the gradient collectives (what a rank puts on the wire, its own chunk included)."""

    def __init__(self):
        from shardtensor import _comm

        self.bytes = 0
        self._comm = _comm
        self._originals = (_comm.reduce_scatter_rows, _comm.all_to_all)

        def reduce_scatter_rows(full, group=None, **kw):
            if _comm.world_size(group) > 1:
                self.bytes += full.numel() * full.element_size()
            return self._originals[0](full, group, **kw)

        def all_to_all(output, input, group=None, **kw):
            if _comm.world_size(group) > 1:
                self.bytes += input.numel() * input.element_size()
            return self._originals[1](output, input, group, **kw)

        _comm.reduce_scatter_rows, _comm.all_to_all = reduce_scatter_rows, all_to_all

    def close(self) -> None:
        self._comm.reduce_scatter_rows, self._comm.all_to_all = self._originals


_CORPUS_FILES = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py", "pathlib.py", "textwrap.py")


def _text_corpus() -> torch.Tensor:
    """Characters of a few Python standard-library sources (ASCII codes, vocabulary 128).

    Why not ``models.synthetic_corpus``: its 2nd-order chain over 512 tokens has ~262k contexts, so in a few
    hundred steps a small GPT only learns the (near-uniform) unigram distribution and every reducer ends at the
    same loss; real text has structure a small model learns within 300 steps, so the curves can differ.
    """
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    text = "".join(open(os.path.join(stdlib, name), encoding="utf-8").read() for name in _CORPUS_FILES)
    return torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)


def _train(rank: int, world: int, port: int, reducer_name: str, args: dict) -> dict:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        from shardtensor import _comm, shard_module
        from shardtensor.models import GPT, GPTConfig, get_batch

        cfg = GPTConfig(**args["model"])
        torch.manual_seed(0)  # same weights on every rank and in every run
        model = GPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        reducer = _make_reducer(reducer_name)
        shard_module(model, reducer=reducer)
        opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], weight_decay=0.0)
        corpus = _text_corpus()
        train, held_out = corpus[: int(0.9 * corpus.numel())], corpus[int(0.9 * corpus.numel()) :]
        # each rank its own batches, the same in every run; "name@seedK" draws other batches (the noise floor)
        data_seed = int(reducer_name.split("@seed")[1]) if "@seed" in reducer_name else 0
        data = torch.Generator().manual_seed(1000 * (data_seed + 1) + rank)
        counter = _WireCounter()
        losses, step_bytes, times = [], [], []
        for step in range(args["steps"]):
            lr = args["lr"] * min(1.0, (step + 1) / args["warmup"])  # linear warmup, then constant
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = get_batch(train, args["batch"], cfg.block_size, data)
            before = counter.bytes
            t0 = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            step_bytes.append(counter.bytes - before)
            mean_loss = loss.detach().clone()
            _comm.all_reduce(mean_loss, op="avg")
            losses.append(mean_loss.item())
        counter.close()
        with torch.no_grad():  # held-out loss: the same batches on every rank and run
            eval_gen = torch.Generator().manual_seed(7)
            eval_losses = [model(*get_batch(held_out, args["batch"], cfg.block_size, eval_gen)).item() for _ in range(8)]
        return {
            "losses": losses,
            "eval_loss": sum(eval_losses) / len(eval_losses),
            "bytes_per_step": step_bytes,
            "reducer_bytes_sent": getattr(reducer, "bytes_sent", None),
            "step_seconds": times,
            "n_params": n_params,
        }  # fmt: skip
    finally:
        dist.destroy_process_group()


def run(reducer_name: str, world: int, args: dict) -> dict:
    return run_or_exit(_train, world, reducer_name, args)[0]  # a failed rank: its traceback, exit code 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--reducers", default=",".join(REDUCERS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "compression"))
    opts = parser.parse_args()

    args = {
        "steps": opts.steps,
        "batch": opts.batch,
        "lr": opts.lr,
        "warmup": max(1, opts.steps // 20),
        "corpus": f"python {platform.python_version()} stdlib sources {', '.join(_CORPUS_FILES)}, characters",
        "model": {"vocab_size": 128, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 128},
    }
    tail = max(1, opts.steps // 10)
    runs: dict[str, dict] = {}
    for name in opts.reducers.split(","):
        t = time.perf_counter()
        res = run(name, opts.world, args)
        res["final_loss"] = sum(res["losses"][-tail:]) / tail
        res["wall_seconds"] = time.perf_counter() - t
        runs[name] = res
        print(f"{name:8s} final loss {res['final_loss']:.4f}  held-out {res['eval_loss']:.4f}  "
              f"{res['bytes_per_step'][-1] / 1e6:.3f} MB/step  ({res['wall_seconds']:.0f} s)", flush=True)  # fmt: skip

    ref = runs.get("fp32")
    rows = []
    for name, res in runs.items():
        step_bytes = res["bytes_per_step"][-1]
        assert len(set(res["bytes_per_step"])) == 1, f"{name}: wire bytes differ between steps"
        if res["reducer_bytes_sent"] is not None:  # the reducer's own count agrees with the wrapped collectives
            assert res["reducer_bytes_sent"] == sum(res["bytes_per_step"]), (name, res["reducer_bytes_sent"])
        rows.append({
            "reducer": name,
            "bytes_per_step": step_bytes,
            "bytes_vs_fp32": (ref["bytes_per_step"][-1] / step_bytes) if ref else None,
            "final_loss": res["final_loss"],
            "final_loss_gap_vs_fp32": (res["final_loss"] / ref["final_loss"] - 1) if ref else None,
            "held_out_loss": res["eval_loss"],
            "held_out_gap_vs_fp32": (res["eval_loss"] / ref["eval_loss"] - 1) if ref else None,
            "median_step_ms": 1e3 * sorted(res["step_seconds"])[len(res["step_seconds"]) // 2],
        })  # fmt: skip

    header = f"{'reducer':8s} {'bytes/step/rank':>15s} {'x fewer':>8s} {'final loss':>10s} {'gap':>8s} {'held-out':>9s} {'gap':>8s} {'ms/step':>8s}"
    lines = [header]
    for r in rows:
        ratio = f"{r['bytes_vs_fp32']:.2f}" if r["bytes_vs_fp32"] else "-"
        gap = f"{100 * r['final_loss_gap_vs_fp32']:+.2f}%" if r["final_loss_gap_vs_fp32"] is not None else "-"
        egap = f"{100 * r['held_out_gap_vs_fp32']:+.2f}%" if r["held_out_gap_vs_fp32"] is not None else "-"
        lines.append(
            f"{r['reducer']:8s} {r['bytes_per_step']:15,d} {ratio:>8s} {r['final_loss']:10.4f} {gap:>8s} "
            f"{r['held_out_loss']:9.4f} {egap:>8s} {r['median_step_ms']:8.1f}"
        )
    table = "\n".join(lines)
    print(table)

    n_params = next(iter(runs.values()))["n_params"]
    os.makedirs(os.path.dirname(opts.out) or ".", exist_ok=True)
    meta = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], os.path.join(os.path.dirname(__file__), ".."))] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "torch": torch.__version__,
        "world": opts.world,
        "config": args,
        "n_params": n_params,
        "setup": "shard_module(GPT, reducer=...) on gloo CPU ranks, AdamW; final loss = mean of the last "
        f"{tail} rank-averaged training losses; held-out = 8 fixed batches after training",
        "wire_bytes": "bytes handed to the gradient collectives per rank per step (reduce_scatter input / "
        "all_to_all input), measured by wrapping _comm",
    }  # fmt: skip
    with open(opts.out + ".json", "w") as f:
        json.dump({"meta": meta, "table": rows, "losses": {n: r["losses"] for n, r in runs.items()}}, f, indent=1)
    with open(opts.out + ".txt", "w") as f:
        f.write(f"# {meta['command']}\n# {meta['machine']}, torch {meta['torch']}, world {opts.world}, "
                f"{n_params:,} params\n{table}\n")  # fmt: skip

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install -e '.[bench]')")
        return
    fig, (ax, axz) = plt.subplots(1, 2, figsize=(12, 4.5))
    k = max(1, opts.steps // 50)
    for name, res in runs.items():
        smooth = [sum(res["losses"][max(0, i - k + 1) : i + 1]) / len(res["losses"][max(0, i - k + 1) : i + 1]) for i in range(len(res["losses"]))]
        label = f"{name} ({res['bytes_per_step'][-1] / 1e6:.2f} MB/step)"
        ax.plot(smooth, label=label)
        axz.plot(range(opts.steps // 2, opts.steps), smooth[opts.steps // 2 :], label=label)
    ax.set(xlabel="step", ylabel=f"training loss (moving mean of {k})", title=f"GPT {n_params / 1e6:.2f}M params, {opts.world} CPU ranks")
    axz.set(xlabel="step", title="second half")
    ax.legend()
    axz.legend()
    fig.suptitle(meta["command"], fontsize=8)
    fig.tight_layout()
    fig.savefig(opts.out + ".png", dpi=120)
    print(f"wrote {opts.out}.json, .txt, .png")


if __name__ == "__main__":
    main()
