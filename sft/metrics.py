"""Throughput accounting: FLOPs per token, MFU, memory, start-up time."""

from __future__ import annotations

import datetime
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from sft.config import LoggingConfig

# Dense bf16 peak of an H100/H200 SXM (the MFU denominator used in docs/BENCHMARKS.md).
PEAK_BF16_FLOPS = 989e12


def flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6*N for the matmuls with the weights (forward + backward) plus
    6*L*s*h for attention scores and values (PaLM's formula; recomputation not counted)."""
    return 6 * num_params + 6 * num_layers * seq_len * hidden


def peak_memory_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


_IMPORTED_AT = time.time()


def seconds_since_process_start() -> float:
    """Wall time since this process was exec'd (Linux /proc), so imports are counted too;
    elsewhere since this module was imported."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED_AT


def host_peak_rss_gib() -> float:
    """Peak resident host memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Rank 0's sinks for step metrics: metrics.jsonl (always), the console or a progress bar,
    TensorBoard and Weights & Biases (optional; imported only when enabled).

    metrics.jsonl has one JSON object per optimizer step with the keys documented in the README
    ("Run directory"), and one {"step", "eval_loss"} object per evaluation.
    """

    def __init__(self, run_dir: Path, cfg: LoggingConfig, run_name: str, config: dict, total_steps: int,
                 start_step: int, enabled: bool):
        self.enabled, self.cfg, self.total_steps = enabled, cfg, total_steps
        if not enabled:
            return
        self.jsonl = open(run_dir / "metrics.jsonl", "a" if start_step else "w")
        self.bar = None
        if cfg.progress == "bar" or (cfg.progress == "auto" and sys.stdout.isatty()):
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.tensorboard = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(str(run_dir / "tb"))
        self.wandb = None
        if cfg.wandb_project:
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, name=run_name, config=config,
                                    dir=str(run_dir), resume="allow")

    def log(self, entry: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(entry) + "\n")
        self.jsonl.flush()
        step = entry["step"]
        scalars = {k: v for k, v in entry.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(scalars, step=step)
        if "loss" not in entry:  # an evaluation
            self.message(f"step {step}: eval loss {entry['eval_loss']:.4f}")
        elif self.bar:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{entry['loss']:.4f}", tok_s_gpu=f"{entry['tokens_per_s_per_gpu']:,.0f}")
        elif step % self.cfg.every_steps == 0 or step == self.total_steps:
            self.message(format_step(entry, self.total_steps))

    def message(self, text: str) -> None:
        """A log line that does not break the progress bar."""
        if not self.enabled:
            return
        line = time.strftime("[%H:%M:%S] ") + text
        if self.bar:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.jsonl.close()
        if self.bar:
            self.bar.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def read_metrics(run_dir: Path) -> tuple[dict[int, dict], dict[int, float]]:
    """A run's metrics.jsonl as (step -> training entry, step -> eval loss); where a resumed run
    repeated steps, the last entry wins."""
    steps, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "eval_loss" in entry:
            evals[entry["step"]] = entry["eval_loss"]
        else:
            steps[entry["step"]] = entry
    return steps, evals


def format_step(entry: dict, total_steps: int) -> str:
    line = (f"step {entry['step']}/{total_steps} | loss {entry['loss']:.4f} | grad norm {entry['grad_norm']:.3f} | "
            f"lr {entry['lr']:.2e} | {entry['tokens_per_s_per_gpu']:,.0f} tok/s/gpu")
    if "mfu" in entry:
        line += f" | MFU {entry['mfu']:.1%} | peak {entry['peak_memory_gib']:.1f} GiB"
    return line + f" | {entry['step_time']:.2f} s/step | ETA {datetime.timedelta(seconds=round(entry['eta_s']))}"
