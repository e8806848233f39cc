"""Compare float8 runs, or lean-optimizer-state runs, with bf16: final held-out losses, relative
differences, a plot.

    python scripts/plot_float8.py runs/bench/f8num-*/ --out docs/float8_numerics.png
    python scripts/plot_float8.py runs/bench/leannum-*/ --out docs/lean_state_numerics.png --tolerance 0.01

Each run's recipe and seed come from its config.yaml (precision.float8, or optim.state_dtype and
optim.master_dtype when those are bfloat16; train.seed). A float8 (or lean) run is
compared with the bf16 run of the same seed (same init and data order: the difference is float8's
alone) at the last eval step both reached (a run cut short is compared where it stopped); the
spread of the bf16 runs over seeds is the scale against which that difference is judged.
Prints markdown tables (for docs/BENCHMARKS.md); the plot needs matplotlib.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

from sft.training.metrics import read_metrics

# The float8 issue's acceptance bound: float8's final eval loss within 2% of bf16's (lean state: 1%).
TOLERANCE = 0.02
COLOURS = {"none": "tab:blue", "tensorwise": "tab:orange", "rowwise": "tab:green", "moments bf16": "tab:orange",
           "moments + master bf16": "tab:green"}


def recipe_of(config: dict) -> str:
    """The run's recipe: its float8 recipe, else its lean optimizer state, else "none" (bf16 compute,
    fp32 masters and moments: the baseline)."""
    optim = config.get("optim", {})
    if optim.get("master_dtype", "float32") == "bfloat16":
        return "moments + master bf16"
    if optim.get("state_dtype", "float32") == "bfloat16":
        return "moments bf16"
    return config["precision"]["float8"]


def summary(run_dir: Path) -> dict:
    steps, evals = read_metrics(run_dir)
    if not evals:
        raise SystemExit(f"{run_dir}: no eval_loss in metrics.jsonl (did the run finish?)")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    steady = [steps[s]["tokens_per_s_per_gpu"] for s in sorted(steps)[5:]] or [float("nan")]
    return {"run": run_dir.name, "recipe": recipe_of(config), "seed": config["train"]["seed"],
            "steps": max(steps), "final": evals[max(evals)], "tok/s/GPU": statistics.median(steady),
            "evals": evals, "train": {s: steps[s]["loss"] for s in sorted(steps)}}


def plot(runs: list[dict], bf16: dict[int, dict], out: Path, tolerance: float) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eval, ax_rel, ax_train) = plt.subplots(1, 3, figsize=(16, 4))
    for run in runs:
        style = dict(color=COLOURS.get(run["recipe"]), ls=("-", "--", ":", "-.")[run["seed"] % 4],
                     label=f"{'bf16' if run['recipe'] == 'none' else run['recipe']}, seed {run['seed']}")
        evals, train = run["evals"], run["train"]
        ax_eval.plot(sorted(evals), [evals[s] for s in sorted(evals)], marker="o", ms=3, **style)
        base = bf16.get(run["seed"])
        if base is not None and run["recipe"] != "none":
            common = sorted(set(evals) & set(base["evals"]))
            ax_rel.plot(common, [100 * (evals[s] / base["evals"][s] - 1) for s in common], marker="o", ms=3, **style)
        steps = sorted(train)  # 20-step running mean: one batch's loss is noisy
        smooth = [statistics.mean(train[t] for t in steps[max(0, i - 19):i + 1]) for i in range(len(steps))]
        ax_train.plot(steps, smooth, lw=1, **style)
    ax_eval.set(xlabel="step", ylabel="held-out loss per token", yscale="log", title="eval loss")
    ax_rel.axhspan(-100 * tolerance, 100 * tolerance, color="green", alpha=0.1, label=f"±{tolerance:.0%}")
    ax_rel.set(xlabel="step", ylabel="eval loss vs bf16 of the same seed (%)", title="run - bf16, same seed")
    ax_train.set(xlabel="step", ylabel="training loss (20-step mean)", yscale="log", title="training loss")
    for ax in (ax_eval, ax_rel, ax_train):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (bf16 and float8, one or more seeds)")
    parser.add_argument("--out", type=Path, default=Path("docs/float8_numerics.png"))
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="the acceptance bound (lean state: 0.01)")
    args = parser.parse_args()
    missing = [str(r) for r in args.runs if not (r / "metrics.jsonl").is_file()]
    if missing:
        print(f"missing runs (left out): {', '.join(missing)}")
    runs = sorted((summary(r) for r in args.runs if str(r) not in missing),
                  key=lambda r: (r["recipe"] != "none", r["recipe"], r["seed"]))
    bf16 = {r["seed"]: r for r in runs if r["recipe"] == "none"}
    if not bf16:
        raise SystemExit("no bf16 run (precision.float8: none) to compare with")
    print("| run | recipe | seed | steps | final eval loss | vs bf16, same seed and step | tok/s/GPU |")
    print("|---|---|---|---|---|---|---|")
    paired: dict[str, list[float]] = {}
    for run in runs:
        base, rel = bf16.get(run["seed"]), ""
        common = set(run["evals"]) & set(base["evals"]) if base else set()
        if common and run["recipe"] != "none":
            step = max(common)
            paired.setdefault(run["recipe"], []).append(run["evals"][step] / base["evals"][step] - 1)
            rel = f"{paired[run['recipe']][-1]:+.2%} (step {step})"
        print(f"| {run['run']} | {run['recipe']} | {run['seed']} | {run['steps']} | {run['final']:.4f} | {rel} | "
              f"{run['tok/s/GPU']:,.0f} |")
    finals = [r["final"] for r in bf16.values()]
    spread = (max(finals) - min(finals)) / statistics.mean(finals)
    print(f"\nbf16 over {len(finals)} seeds: final eval loss mean {statistics.mean(finals):.4f}, "
          f"spread (max - min) / mean {spread:.2%}\n")
    print("| recipe | seeds | mean difference from bf16 (same seed and step) | largest | "
          f"within {args.tolerance:.0%} |")
    print("|---|---|---|---|---|")
    for recipe, diffs in sorted(paired.items()):
        mean, worst = statistics.mean(diffs), max(diffs, key=abs)
        print(f"| {recipe} | {len(diffs)} | {mean:+.2%} | {worst:+.2%} | "
              f"{'yes' if abs(mean) <= args.tolerance and abs(worst) <= args.tolerance else 'NO'} |")
    plot(runs, bf16, args.out, args.tolerance)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
