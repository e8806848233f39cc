"""Plot a run's curves: `python -m sft.plot <run_dir>` writes <run_dir>/curves.png.

Training loss, held-out loss, learning rate and throughput against the optimizer step, read from
metrics.jsonl. Needs matplotlib (pip install matplotlib); nothing else in sft imports it.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from sft import atomic
from sft.errors import UserError, run_command
from sft.training.metrics import read_metrics


def plot(run_dir: Path) -> Path:
    """Write <run_dir>/curves.png (atomically, replacing the plot's own earlier one) and return its path."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl there; give a run directory "
                        "(<train.output_dir>/<train.run_name>)")
    try:
        import matplotlib
    except ImportError:
        raise UserError("sft.plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = read_metrics(run_dir)
    x = sorted(steps)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(x, [steps[s]["loss"] for s in x], label="train loss", lw=1)
    if evals:
        axes[0].plot(sorted(evals), [evals[s] for s in sorted(evals)], "o-", label="eval loss")
    axes[0].set(xlabel="step", ylabel="loss (per supervised token)", title="loss")
    axes[0].legend()
    axes[1].plot(x, [steps[s]["lr"] for s in x])
    axes[1].set(xlabel="step", ylabel="learning rate", title="learning rate")
    axes[2].plot(x, [steps[s]["tokens_per_s_per_gpu"] for s in x], label="all tokens")
    axes[2].plot(x, [steps[s]["supervised_tokens_per_s_per_gpu"] for s in x], label="supervised")
    axes[2].set(xlabel="step", ylabel="tokens/s/GPU", title="throughput")
    axes[2].legend()
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "curves.png"
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    atomic.write_file(out, png.getvalue())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    print(f"wrote {plot(parser.parse_args(argv).run_dir)}")


if __name__ == "__main__":
    run_command(main)
