"""Compare float8 runs with their bf16 baseline: final held-out losses, relative differences, a plot.

    python scripts/plot_float8.py runs/bench/f8num-bf16 runs/bench/f8num-tensorwise runs/bench/f8num-rowwise \
        --noise runs/bench/f8num-bf16-seed1 --out docs/float8_numerics.png

The first run is the baseline. `--noise`: a bf16 run with another seed (init and data order), to
show how far two bf16 runs land apart, the scale against which float8's difference is judged.
Prints a markdown table (for docs/BENCHMARKS.md); the plot needs matplotlib.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from sft.metrics import read_metrics

# The acceptance bound: float8's final eval loss within 2% of bf16's.
TOLERANCE = 0.02


def summary(run_dir: Path) -> dict:
    steps, evals = read_metrics(run_dir)
    if not evals:
        raise SystemExit(f"{run_dir}: no eval_loss in metrics.jsonl (did the run finish?)")
    last = [steps[s]["loss"] for s in sorted(steps)[-20:]]
    steady = [steps[s]["tokens_per_s_per_gpu"] for s in sorted(steps)[5:]] or [float("nan")]
    return {"run": run_dir.name, "steps": max(steps), "final eval loss": evals[max(evals)],
            "train loss (last 20 steps)": statistics.mean(last), "tok/s/GPU": statistics.median(steady),
            "evals": evals, "train": {s: steps[s]["loss"] for s in sorted(steps)}}


def plot(runs: list[dict], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eval, ax_rel, ax_train) = plt.subplots(1, 3, figsize=(16, 4))
    base = runs[0]["evals"]
    for run in runs:
        evals, train = run["evals"], run["train"]
        ax_eval.plot(sorted(evals), [evals[s] for s in sorted(evals)], "o-", ms=3, label=run["run"])
        # the curves overlap on a log scale: the relative gap to bf16 at each eval shows more
        common = sorted(set(evals) & set(base))
        ax_rel.plot(common, [100 * (evals[s] / base[s] - 1) for s in common], "o-", ms=3, label=run["run"])
        # 10-step running mean: the per-step loss of a 16-conversation batch is noisy
        steps = sorted(train)
        smooth = [statistics.mean(train[t] for t in steps[max(0, i - 9):i + 1]) for i in range(len(steps))]
        ax_train.plot(steps, smooth, lw=1, label=run["run"])
    ax_eval.set(xlabel="step", ylabel="held-out loss per supervised token", yscale="log", title="eval loss")
    ax_rel.axhspan(-100 * TOLERANCE, 100 * TOLERANCE, color="green", alpha=0.1, label=f"±{TOLERANCE:.0%}")
    ax_rel.set(xlabel="step", ylabel="eval loss vs the bf16 run (%)", title="relative difference")
    ax_train.set(xlabel="step", ylabel="training loss (10-step mean)", yscale="log", title="training loss")
    for ax in (ax_eval, ax_rel, ax_train):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="baseline (bf16) run first, then the float8 runs")
    parser.add_argument("--noise", type=Path, action="append", default=[], help="bf16 runs with another seed")
    parser.add_argument("--out", type=Path, default=Path("docs/float8_numerics.png"))
    args = parser.parse_args()
    found = [r for r in args.runs + args.noise if (r / "metrics.jsonl").is_file()]
    missing = [str(r) for r in args.runs + args.noise if r not in found]
    if missing:
        print(f"missing runs (left out): {', '.join(missing)}")
    if not found or found[0] != args.runs[0]:
        raise SystemExit(f"the baseline {args.runs[0]} has no metrics.jsonl")
    runs = [summary(r) for r in found]
    base = runs[0]["final eval loss"]
    print("| run | steps | final eval loss | vs bf16 | train loss (last 20) | tok/s/GPU | within 2% |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        rel = run["final eval loss"] / base - 1
        print(f"| {run['run']} | {run['steps']} | {run['final eval loss']:.4f} | {rel:+.2%} | "
              f"{run['train loss (last 20 steps)']:.4f} | {run['tok/s/GPU']:,.0f} | "
              f"{'yes' if abs(rel) <= TOLERANCE else 'NO'} |")
    plot(runs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
