"""Throughput accounting: FLOPs per token, MFU, memory, start-up time."""

from __future__ import annotations

import os
import resource
import time

import torch

# Dense bf16 peak of an H100/H200 SXM (the MFU denominator used in docs/BENCHMARKS.md).
PEAK_BF16_FLOPS = 989e12


def flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6*N for the matmuls with the weights (forward + backward) plus
    6*L*s*h for attention scores and values (PaLM's formula; recomputation not counted)."""
    return 6 * num_params + 6 * num_layers * seq_len * hidden


def peak_memory_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def seconds_since_process_start() -> float:
    """Wall time since this process was exec'd (Linux /proc), so imports are counted too."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.process_time()


def host_peak_rss_gib() -> float:
    """Peak resident host memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
