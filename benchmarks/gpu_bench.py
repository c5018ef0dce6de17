"""The GPU measurements of issue 23, one subcommand each, each writing one JSON (``gpu_suite.sh`` runs them all).

  - ``world1``: world-1 training step of the 942M GPT (d=2048, 16 blocks, 16 heads, V=32768, T=1024, batch 4;
    bf16 compute, fp32 master, fused AdamW where the parameters take it) under shardtensor (sequential,
    overlapped) and FSDP2 (``fully_shard`` per block, ``MixedPrecisionPolicy(bf16, fp32)``) against the plain model
    (``torch.autocast(bf16)``): step time (median over interleaved rounds) and peak GPU memory
  - ``fake8``: one configuration as rank 3 of 8 on torch's fake process group (collectives move nothing, every
    allocation is real): peak GPU memory and step time, ``--ckpt`` for per-block activation checkpointing
  - ``cpuadam``: ``shardtensor.optim.CPUAdam`` on GPU parameters, speculative (steps during backward) against the
    ZeRO-Offload order (``speculative=False``: the optimizer after backward), on an MLP of >= 2B parameters
  - ``offload``: world-1 shardtensor with and without ``CPUOffload`` (CPUAdam in both): GPU memory and step time
  - ``parity``: 2 gloo ranks whose tensors live on the GPU against the same run on the CPU: losses must agree

``--dry-run`` (or ``SHARDTENSOR_DRY_RUN=1``) runs a tiny config on whatever device is there (the CPU here): it
checks the wiring and the JSON, and its figures mean nothing.  Every figure comes with the device's name.

    python benchmarks/gpu_bench.py world1 --out /tmp/w1.json
    python benchmarks/gpu_bench.py fake8 --config fsdp2 --ckpt --out /tmp/f.json
    python benchmarks/gpu_bench.py parity --dry-run --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

from shardtensor.launch import spawn_ranks  # noqa: E402
from shardtensor.models import GPT, GPTConfig  # noqa: E402

GPT_942M = dict(vocab_size=32768, block_size=1024, n_layer=16, n_head=16, n_embd=2048)
GPT_TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
FAKE_CONFIGS = ["plain", "fsdp2", "st-sequential", "st-overlapped"]


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mark(device: torch.device) -> int:
    """Bytes allocated now; resets the peak counter (CUDA).  On the CPU: RSS (dry-run figures, not claims)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    import psutil

    return psutil.Process().memory_info().rss


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _header(args: argparse.Namespace) -> dict:
    dev = _device()
    return {"command": "python benchmarks/gpu_bench.py " + " ".join(sys.argv[1:]), "dry_run": args.dry_run,
            "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else f"cpu ({platform.processor()})",
            "torch": torch.__version__, "cuda": torch.version.cuda, "figures_valid": not args.dry_run
            and dev.type == "cuda"}


def _gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(**(GPT_TINY if args.dry_run else GPT_942M))


def _adamw(params, fused: bool = True) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params), lr=1e-4, fused=True) if fused else torch.optim.AdamW(list(params), lr=1e-4)


def _train(model: torch.nn.Module, config: str, device: torch.device, x: torch.Tensor, warmup: int,
           steps: int) -> tuple[list[float], str]:
    """Step times with fused AdamW; where the parameters refuse it (at construction or at the first step, e.g.
    an op the tensor subclass does not route), the default AdamW, and the reason recorded."""
    try:
        opt = _adamw(model.parameters())
        return _timed(_step_fn(model, opt, config, device), x, device, warmup, steps), "fused"
    except Exception as e:  # noqa: BLE001 - the fallback is recorded in the JSON
        note = f"default (fused failed: {type(e).__name__}: {str(e)[:300]})"
    model.zero_grad(set_to_none=True)
    opt = _adamw(model.parameters(), fused=False)
    return _timed(_step_fn(model, opt, config, device), x, device, warmup, steps), note


def _checkpoint_blocks(model: torch.nn.Module) -> None:
    """Per-block activation checkpointing: each block keeps its input only and recomputes in backward."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)


def _wrap(model: torch.nn.Module, config: str, device: torch.device) -> torch.nn.Module:
    if config == "plain":
        return model
    if config == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    import shardtensor

    return shardtensor.shard_module(model, gather=config.removeprefix("st-"), param_dtype=torch.bfloat16,
                                    reduce_dtype=torch.float32)


def _step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer, config: str,
             device: torch.device) -> Callable[[torch.Tensor], float]:
    def step(x: torch.Tensor) -> torch.Tensor:
        if config == "plain":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, x)
        else:
            loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _timed(step: Callable, x: torch.Tensor, device: torch.device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step(x)
    _sync(device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(x)
        _sync(device)
        times.append(time.perf_counter() - t)
    return times


def _init_world1(device: torch.device) -> None:
    import torch.distributed as dist

    from shardtensor.launch import free_port

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


# ---------------------------------------------------------------------------------------------------- world1
def cmd_world1(args: argparse.Namespace) -> dict:
    device = _device()
    _init_world1(device)
    cfg = _gpt_config(args)
    batch = 1 if args.dry_run else 4
    configs = ["plain", "st-sequential", "st-overlapped", "fsdp2"]
    rows: dict[str, dict] = {c: {"step_s_rounds": [], "peak_bytes": [], "optimizer": None} for c in configs}
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device)
    for rnd in range(args.rounds):
        for config in configs[rnd % len(configs):] + configs[:rnd % len(configs)]:
            row = rows[config]
            try:
                base = _mark(device)
                torch.manual_seed(0)
                with torch.device(device):  # built in place: a 942M init on the host takes longer than a step
                    model = GPT(cfg)
                model = _wrap(model, config, device)
                times, row["optimizer"] = _train(model, config, device, x, args.warmup, args.steps)
                row["step_s_rounds"].append(statistics.median(times))
                row["peak_bytes"].append(_peak(device) - base)
                del model
            except Exception as e:  # noqa: BLE001 - recorded, the other configs still run
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc()[-3000:]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    plain = rows["plain"]
    for r in rows.values():
        if r["step_s_rounds"]:
            r["step_s"] = statistics.median(r["step_s_rounds"])
            r["peak_gib"] = max(r["peak_bytes"]) / 2**30
        if r.get("step_s") and plain.get("step_s"):
            r["step_x_plain"] = r["step_s"] / plain["step_s"]
    return {"model": vars(cfg), "batch": batch, "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
            "target": "shardtensor step <= 1.15x plain", "configs": rows}


# ---------------------------------------------------------------------------------------------------- fake8
def cmd_fake8(args: argparse.Namespace) -> dict:
    """One configuration per process: the fake group lives for the whole process, and peaks must not mix."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = _gpt_config(args)
    batch = 1 if args.dry_run else 4
    row: dict = {"config": args.config, "ckpt": args.ckpt, "world": 8, "rank": 3}
    try:
        if args.config != "plain":
            dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
        base = _mark(device)
        torch.manual_seed(0)
        if args.config == "plain":
            with torch.device(device):
                model = GPT(cfg)
        else:
            with torch.device("meta"):
                model = GPT(cfg)
        if args.ckpt:
            _checkpoint_blocks(model)
        model = _wrap(model, args.config, device)
        if args.config == "fsdp2":
            model.to_empty(device=device)  # this rank's shards only; values do not matter for memory
        elif args.config.startswith("st-"):
            import shardtensor

            shardtensor.materialize(model, device=device)
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device)
        times, row["optimizer"] = _train(model, args.config, device, x, args.warmup, args.steps)
        row.update(step_s=statistics.median(times), step_times_s=times, peak_gib=(_peak(device) - base) / 2**30)
    except Exception as e:  # noqa: BLE001
        row.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    return {"model": vars(cfg), "batch": batch, "row": row,
            "note": "memory: peak allocated minus allocated before the model; time: compute only (nothing moves)"}


# ---------------------------------------------------------------------------------------------------- cpuadam
def cmd_cpuadam(args: argparse.Namespace) -> dict:
    from shardtensor.optim import CPUAdam

    device = _device()
    width, layers = (64, 4) if args.dry_run else (8192, 32)  # 32 x 8192^2 = 2.15B parameters, 8.6 GB fp32
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, device=device) for _ in range(layers)])
    x = torch.randn(8, width, device=device)
    rows = {}
    for name, speculative in (("speculative", True), ("zero-offload-order", False)):
        row: dict = {"speculative": speculative}
        try:
            base = _mark(device)
            opt = CPUAdam(model.parameters(), lr=1e-5, speculative=speculative)

            def step(_x: torch.Tensor) -> None:
                model(_x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            times = _timed(step, x, device, args.warmup, args.steps)
            row.update(step_s=statistics.median(times), step_times_s=times,
                       gpu_peak_gib=(_peak(device) - base) / 2**30)
            del opt
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        rows[name] = row
    if "step_s" in rows["speculative"] and "step_s" in rows["zero-offload-order"]:
        rows["speculative"]["step_x_zero_offload_order"] = (rows["speculative"]["step_s"]
                                                           / rows["zero-offload-order"]["step_s"])
    return {"params": sum(p.numel() for p in model.parameters()), "width": width, "layers": layers,
            "target": "speculative step <= 0.75x the ZeRO-Offload order", "configs": rows}


# ---------------------------------------------------------------------------------------------------- offload
def cmd_offload(args: argparse.Namespace) -> dict:
    import shardtensor
    from shardtensor.offload import CPUOffload
    from shardtensor.optim import CPUAdam

    device = _device()
    _init_world1(device)
    cfg = _gpt_config(args)
    batch = 1 if args.dry_run else 4
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device)
    rows = {}
    for name in ("resident", "cpu-offload"):
        row: dict = {}
        try:
            base = _mark(device)
            torch.manual_seed(0)
            offload = CPUOffload(pin_memory=True) if name == "cpu-offload" else None
            with torch.device(device):
                model = GPT(cfg)
            model = shardtensor.shard_module(model, gather="overlapped", param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32, offload=offload)
            opt = CPUAdam(model.parameters(), lr=1e-4)
            times = _timed(_step_fn(model, opt, name, device), x, device, args.warmup, args.steps)
            row.update(step_s=statistics.median(times), gpu_peak_gib=(_peak(device) - base) / 2**30)
            del model, opt
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
            # CPUOffload refuses a machine without CUDA by design: on the dry run that refusal is the check.
            row["expected"] = device.type != "cuda" and name == "cpu-offload" and "CPUOffload" in row["error"]
        rows[name] = row
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "gpu_peak_gib" in rows["resident"] and "gpu_peak_gib" in rows["cpu-offload"]:
        rows["cpu-offload"]["memory_saved_gib"] = rows["resident"]["gpu_peak_gib"] - rows["cpu-offload"]["gpu_peak_gib"]
    return {"model": vars(cfg), "batch": batch, "configs": rows}


# ---------------------------------------------------------------------------------------------------- parity
def _parity_rank(rank: int, world: int, port: int, device_type: str, dry_run: bool) -> dict:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        import shardtensor

        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        cfg = GPTConfig(**GPT_TINY)
        out = {}
        for mode in ("sequential", "overlapped"):
            torch.manual_seed(0)
            model = shardtensor.shard_module(GPT(cfg).to(device), gather=mode)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
            gen = torch.Generator().manual_seed(rank)
            losses = []
            for _ in range(3):
                x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=gen).to(device)
                loss = model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            out[mode] = losses
        return {"rank": rank, "losses": out}
    except Exception as e:  # reported as this rank's row, so the suite's JSON says what failed
        return {"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def cmd_parity(args: argparse.Namespace) -> dict:
    target = "cuda" if torch.cuda.is_available() else "cpu"
    runs = {}
    for device_type in ("cpu", target):
        rows = sorted(spawn_ranks(_parity_rank, 2, device_type, args.dry_run, timeout=600),
                      key=lambda r: r["rank"])
        runs[device_type] = rows
    result: dict = {"world": 2, "backend": "gloo", "compared": ["cpu", target], "runs": runs}
    if all("losses" in r for rows in runs.values() for r in rows):
        diff = max(abs(a - b) for r_cpu, r_dev in zip(runs["cpu"], runs[target])
                   for mode in r_cpu["losses"] for a, b in zip(r_cpu["losses"][mode], r_dev["losses"][mode]))
        result.update(max_abs_loss_diff=diff, tolerance=1e-4, passed=diff <= 1e-4)
    else:
        result["passed"] = False
    return result


COMMANDS = {"world1": cmd_world1, "fake8": cmd_fake8, "cpuadam": cmd_cpuadam, "offload": cmd_offload,
            "parity": cmd_parity}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=sorted(COMMANDS))
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("SHARDTENSOR_DRY_RUN") == "1",
                    help="tiny configs, any device: checks the wiring; figures mean nothing")
    ap.add_argument("--config", default="fsdp2", choices=FAKE_CONFIGS, help="fake8: the configuration")
    ap.add_argument("--ckpt", action="store_true", help="fake8: per-block activation checkpointing")
    ap.add_argument("--rounds", type=int, default=2, help="world1: interleaved rounds (Default: 2)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (Default: 5; 2 on a dry run)")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.dry_run else 5
    if args.dry_run:
        args.warmup = min(args.warmup, 1)
    started = time.perf_counter()
    result = {**_header(args), "benchmark": args.command, **COMMANDS[args.command](args)}
    result["elapsed_s"] = time.perf_counter() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = json.dumps(result, default=str)
    failed = '"error"' in text and not _only_expected_errors(result)
    print(f"{args.command}: wrote {args.out} ({result['elapsed_s']:.0f} s){' WITH ERRORS' if failed else ''}")
    return 1 if failed or result.get("passed") is False else 0


def _only_expected_errors(result: dict) -> bool:
    """True when every recorded error is one marked expected (CPUOffload's refusal on a machine without CUDA)."""
    rows = list(result.get("configs", {}).values()) + ([result["row"]] if "row" in result else [])
    return all(r.get("expected") for r in rows if isinstance(r, dict) and "error" in r)


if __name__ == "__main__":
    sys.exit(main())
