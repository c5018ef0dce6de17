"""Summary, ratios, markdown tables and the plot for ``bench_peers.py``; also the table generator for the README.

    python benchmarks/peers_report.py benchmarks/results/peers.json            # markdown tables to stdout
    python benchmarks/peers_report.py benchmarks/results/peers.json --rounds   # plus every round's figures

Per configuration and round: memory is the worst rank's peak growth, wall time the mean over ranks of each rank's
median step (ranks wait on each other's collectives), CPU time the SUM over ranks of each rank's median process
CPU seconds per step (what the configuration costs the machine).  Over rounds: median, min and max.  Ratios are of
medians to the same figure of FSDP2, DeepSpeed ZeRO-3 (both variants) and DDP, where those ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys

import torch

REFERENCES = ["fsdp2", "deepspeed", "deepspeed-seq", "ddp"]
METRICS = {"peak_mib": "peak MiB per rank (worst rank)", "step_s": "wall s/step (mean of ranks)",
           "cpu_s": "CPU s/step (sum over ranks)"}
# Issue 20's acceptance ratios.
TARGET_SEQ_VS_DS_SEQ = 0.60
TARGET_SEQ_ABOVE_FLOOR = 0.01
TARGET_OVERLAPPED = {"fsdp2": 0.90, "deepspeed": 1.0, "ddp": 1.1}


def per_round(runs: dict[str, list[list[dict]]]) -> dict[str, list[dict]]:
    """``{config: [one dict per round]}`` of the configuration-level figures (see the module docstring)."""
    out = {}
    for config, rounds in runs.items():
        out[config] = [{"peak_mib": max(r["peak_mib"] for r in ranks),
                        "step_s": statistics.mean(r["step_s"] for r in ranks),
                        "cpu_s": sum(r["cpu_s"] for r in ranks),
                        "floor_mib": _floor(ranks)} for ranks in rounds]
    return out


def _floor(ranks: list[dict]) -> float:
    """The ZeRO-3 floor from a ``local`` round: its extra forward+backward peak with gradients sharded on arrival,
    its whole parameters and AdamW moments swapped for one rank's shards (worst rank); NaN for other configs."""
    if "floor_step_peak_mib" not in ranks[0]:
        return math.nan
    return max(r["floor_step_peak_mib"] - r["state_full_mib"] + r["state_shard_mib"] for r in ranks)


def summarize(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Median, min and max over rounds of each figure; ratios of medians to every reference that ran."""
    summary = {}
    for config, rs in rounds.items():
        s = {}
        for m in list(METRICS) + ["floor_mib"]:
            vals = [r[m] for r in rs]
            s[m] = statistics.median(vals)
            s[m + "_min"], s[m + "_max"] = min(vals), max(vals)
        s["rounds"] = len(rs)
        summary[config] = s
    for s in summary.values():
        for ref in REFERENCES:
            if ref in summary:
                for m in METRICS:
                    s[f"{m}_x_{ref}"] = s[m] / summary[ref][m]
    return summary


def acceptance(summary: dict[str, dict]) -> list[str]:
    """Issue 20's targets, each with MET / NOT MET, and the floor beside them."""
    out = []
    floor = summary.get("local", {}).get("floor_mib", math.nan)
    if not math.isnan(floor):
        ref = f" = {floor / summary['fsdp2']['peak_mib']:.3f}x FSDP2" if "fsdp2" in summary else ""
        out.append(f"ZeRO-3 floor (local forward+backward, gradients sharded on arrival, parameters and AdamW state "
                   f"as shards) = {floor:.1f} MiB{ref}")
    seq = summary.get("st-sequential")
    if seq is not None:
        if "deepspeed-seq" in summary:
            r = seq["peak_mib_x_deepspeed-seq"]
            out.append(f"st-sequential peak = {r:.3f}x DeepSpeed ZeRO-3 allgather_sequential (target <= "
                       f"{TARGET_SEQ_VS_DS_SEQ}x): {'MET' if r <= TARGET_SEQ_VS_DS_SEQ else 'NOT MET'}")
        if not math.isnan(floor):
            above = seq["peak_mib"] / floor - 1
            out.append(f"st-sequential peak = {above:+.2%} from the ZeRO-3 floor (target within "
                       f"{TARGET_SEQ_ABOVE_FLOOR:.0%}): {'MET' if abs(above) <= TARGET_SEQ_ABOVE_FLOOR else 'NOT MET'}")
        if "fsdp2" in summary:
            out.append(f"st-sequential peak = {seq['peak_mib_x_fsdp2']:.3f}x FSDP2")
    ovl = summary.get("st-overlapped")
    if ovl is not None:
        for ref, target in TARGET_OVERLAPPED.items():
            if ref not in summary:
                continue
            for m, name in (("step_s", "wall"), ("cpu_s", "CPU")):
                r = ovl[f"{m}_x_{ref}"]
                out.append(f"st-overlapped median {name} s/step = {r:.2f}x {ref} (target <= {target}x): "
                           f"{'MET' if r <= target else 'NOT MET'}")
    return out


ALONE = ("local", "zero3-floor")  # configs that train each rank's model alone (no gradient averaging)


def loss_agreement(runs: dict[str, list[list[dict]]]) -> dict:
    """Rank 0's losses of the first round, per config, and the largest difference between configs.  ``local`` and
    ``zero3-floor`` train each rank alone (no gradient averaging): only their first loss is compared."""
    losses = {c: rounds[0][0]["losses"] for c, rounds in runs.items()}
    ref = next((ls for c, ls in losses.items() if c not in ALONE), next(iter(losses.values())))
    worst = max(abs(a - b) for c, ls in losses.items() for a, b in zip(ls[:1] if c in ALONE else ls, ref))
    return {"rank0_losses_round1": losses, "max_abs_diff": worst,
            "compared": "every step of every config; local's and zero3-floor's first step only"}


def _ratio(s: dict, key: str) -> str:
    return f"{s[key]:.2f}" if key in s else "-"


def markdown(result: dict, rounds: bool = False) -> str:
    """The README's tables: one per figure (median [min, max] over rounds, ratios of medians), then the checks."""
    summary = result["summary"]
    refs = [r for r in REFERENCES if r in summary]
    parts = [result["title"], "", f"`{result['command']}`", ""]
    for m, label in METRICS.items():
        parts.append(f"{label}, median [min, max] over {result['config']['repeats']} rounds")
        parts.append("")
        parts.append("| config | median | min | max | " + " | ".join(f"x {r}" for r in refs) + " |")
        parts.append("|---|---:|---:|---:|" + "---:|" * len(refs))
        for c, s in summary.items():
            parts.append(f"| {c} | {s[m]:.3f} | {s[m + '_min']:.3f} | {s[m + '_max']:.3f} | "
                         + " | ".join(_ratio(s, f"{m}_x_{r}") for r in refs) + " |")
        floor = summary.get("local", {})
        if m == "peak_mib" and not math.isnan(floor.get("floor_mib", math.nan)):
            parts.append(f"| ZeRO-3 floor (from local) | {floor['floor_mib']:.3f} | {floor['floor_mib_min']:.3f} | "
                         f"{floor['floor_mib_max']:.3f} | "
                         + " | ".join(f"{floor['floor_mib'] / summary[r]['peak_mib']:.2f}" for r in refs) + " |")
        parts.append("")
    if rounds:
        parts.append("every round (peak MiB / wall s/step / CPU s/step):")
        parts.append("")
        n = max(len(rs) for rs in result["per_round"].values())
        parts.append("| config | " + " | ".join(f"round {i + 1}" for i in range(n)) + " |")
        parts.append("|---|" + "---:|" * n)
        for c, rs in result["per_round"].items():
            parts.append(f"| {c} | " + " | ".join(f"{r['peak_mib']:.1f} / {r['step_s']:.3f} / {r['cpu_s']:.3f}"
                                                  for r in rs) + " |")
        parts.append("")
    parts += [f"- {line}" for line in result["acceptance"]]
    for c, why in result.get("skipped", {}).items():
        parts.append(f"- SKIPPED {c}: {why}")
    for c, n in result.get("rounds_run_again", {}).items():
        parts.append(f"- {c}: {n} round(s) run again after a rank died (printed as RETRY in the run's output)")
    parts.append(f"- losses agree across configs to {result['losses']['max_abs_diff']:.1e} (rank 0, round 1, every "
                 "step; local and zero3-floor, which train each rank alone, their first step)")
    load = result["machine"]
    parts.append(f"- load average before/after: {load['loadavg_before'][0]:.1f} / {load['loadavg_after'][0]:.1f} "
                 f"on {load['cpu_count']} cores")
    return "\n".join(parts) + "\n"


def plot(summary: dict[str, dict], path: str, title: str) -> None:
    """Peak memory against wall and against CPU time per step; bars span min..max over rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, m in zip(axes, ("step_s", "cpu_s")):
        for config, s in summary.items():
            color = ("tab:red" if config == "fsdp2" else "tab:green" if config.startswith("deepspeed")
                     else "tab:gray" if config in ("ddp", "local") else "tab:blue")
            ax.errorbar(s[m], s["peak_mib"], xerr=[[s[m] - s[m + "_min"]], [s[m + "_max"] - s[m]]],
                        yerr=[[s["peak_mib"] - s["peak_mib_min"]], [s["peak_mib_max"] - s["peak_mib"]]],
                        fmt="o", color=color, ms=6, capsize=3, zorder=3)
            ax.annotate(config, (s[m], s["peak_mib"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
        floor = summary.get("local", {}).get("floor_mib", math.nan)
        if not math.isnan(floor):
            ax.axhline(floor, color="black", ls="--", lw=0.8, label="ZeRO-3 floor")
            ax.legend(fontsize=8, loc="best")
        ax.set_xlabel(METRICS[m] + ", median over rounds")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(METRICS["peak_mib"])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(runs: dict[str, list[list[dict]]], args: argparse.Namespace, command: str, skipped: dict[str, str],
          load_before: tuple, elapsed: float) -> dict:
    """Summarize a run of ``bench_peers.py``, print it and write ``<out>.json``, ``<out>.png``, ``<out>_table.md``."""
    rounds = per_round(runs)
    summary = summarize(rounds)
    params = next(iter(runs.values()))[0][0]["params"]
    cfg = {k: getattr(args, k) for k in ("configs", "world", "vocab", "dim", "layers", "heads", "block", "batch",
                                          "lr", "warmup", "steps", "repeats", "prefetch_bytes", "device")}
    title = (f"GPT {params / 1e6:.1f}M params (V={args.vocab}, d={args.dim}, L={args.layers}, T={args.block}), "
             f"batch {args.batch}/rank, AdamW, {args.world} ranks, {args.device}")
    result = {
        "command": command,
        "argv": sys.argv,
        "title": title,
        "config": cfg,
        "skipped": skipped,
        "rounds_run_again": getattr(args, "rounds_run_again", {}),  # configuration -> rounds retried after a rank died
        "model_params": params,
        "env": {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE"),
                "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR")},
        "memory_metric": ("torch.cuda.max_memory_allocated - memory_allocated before the model" if args.device == "cuda"
                          else "ru_maxrss*1024 at the end - psutil rss just before the model is built, per rank; "
                               "worst rank per config"),
        "time_metric": f"per rank: median of {args.steps} steps after {args.warmup} warm-up (forward, backward, "
                       "optimizer step, zero_grad; barrier before each step, untimed); config: mean over ranks",
        "cpu_metric": "per rank: median of time.process_time() per step (the whole process, all threads); "
                      "config: SUM over ranks",
        "rounds_metric": "median, min, max over rounds; a round runs every config once, the list rotated by one "
                         "each round",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "deepspeed": _version("deepspeed"), "cpu_count": os.cpu_count(),
                    "threads_per_rank": max(1, (os.cpu_count() or 1) // args.world),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "per_round": rounds,
        "summary": summary,
        "losses": loss_agreement(runs),
        "elapsed_s": elapsed,
        "runs": {c: [[{k: v for k, v in r.items() if k != "profile"} for r in rep] for rep in reps]
                 for c, reps in runs.items()},
    }
    result["acceptance"] = acceptance(summary)
    table = markdown(result, rounds=True)
    print()
    print(table)
    print(f"{elapsed:.0f} s in all")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(f"{args.out}.json", "w") as f:
        json.dump(result, f, indent=1)
    with open(f"{args.out}_table.md", "w") as f:
        f.write(table)
    plot(summary, f"{args.out}.png", title)
    print(f"wrote {args.out}.json, {args.out}.png, {args.out}_table.md")
    return result


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="markdown tables from a bench_peers.py results JSON")
    ap.add_argument("json")
    ap.add_argument("--rounds", action="store_true", help="also every round's figures")
    a = ap.parse_args()
    with open(a.json) as f:
        print(markdown(json.load(f), rounds=a.rounds), end="")
