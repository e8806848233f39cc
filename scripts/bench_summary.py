"""Summarise benchmark runs: steady-state numbers from each run's metrics.jsonl.

    python scripts/bench_summary.py runs/bench/*/ [--warmup 5]

Steady state = median over the steps after the first `--warmup` (compilation, allocator warm-up),
leaving out the steps traced by the profiler (logging.profile_steps in the run's config.yaml).
On GPUs also the allocator's peak reserved memory and its retries summed over the steady steps.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

from sft.training.metrics import read_metrics


def summarise(run_dir: Path, warmup: int) -> dict:
    by_step, _ = read_metrics(run_dir)
    steps = [by_step[s] for s in sorted(by_step)]
    if not steps:  # stopped before its first step (a timeout during compilation): a row that says so
        return {"run": run_dir.name, "steps": 0}
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    first, last = (config.get("logging") or {}).get("profile_steps") or (0, -1)
    steady = [r for r in steps[warmup:] if not first <= r["step"] <= last] or steps
    median_time = statistics.median(r["step_time"] for r in steady)
    out = {"run": run_dir.name, "steps": len(steps), "s/step": median_time,
           "tok/s/gpu": statistics.median(r["tokens_per_s_per_gpu"] for r in steady),
           "sup tok/s/gpu": statistics.median(r["supervised_tokens_per_s_per_gpu"] for r in steady),
           "peak GiB": max(r["peak_memory_gib"] for r in steps),
           "startup s": steps[0].get("startup_s", float("nan")),
           "first step s": steps[0]["step_time"], "final loss": steps[-1]["loss"]}
    if "mfu" in steady[0]:
        out["MFU"] = statistics.median(r["mfu"] for r in steady)
    if "alloc_retries" in steady[0]:  # GPUs: the caching allocator (sft/training/metrics.py:AllocatorStats)
        out["reserved GiB"] = max(r["peak_reserved_gib"] for r in steps)
        out["retries (steady)"] = sum(r["alloc_retries"] for r in steady)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    rows = [summarise(r, args.warmup) for r in args.runs if (r / "metrics.jsonl").is_file()]
    if not rows:
        raise SystemExit("no metrics.jsonl found")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:,.3f}" if isinstance(r.get(k), float) and abs(r[k]) < 10 else
                                  f"{r[k]:,.0f}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                                  for k in keys) + " |")


if __name__ == "__main__":
    main()
