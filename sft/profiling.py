"""Where does a step's time go? A torch.profiler trace of chosen steps, and its summary.

    logging.profile_steps: [6, 7]         # in the config: trace optimizer steps 6..7 on rank 0
    python -m sft.profiling runs/x/profile/trace-rank0.json.gz    # summarise any Kineto trace

The summary splits the GPU timeline of the traced steps into kernel classes (matrix products,
attention, NCCL collectives, compiled elementwise, optimizer, ...) and measures what a list of
kernel times cannot show: how long the compute stream sat idle, and how much collective time
was not hidden behind computation. On GPUs the traced steps' allocations are recorded too: the
summary ends with the allocator's memory by stream and with what was alive at the highest point of
allocated memory, by where it was allocated (memory-rank0.pickle opens in pytorch.org/memory_viz).
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

STEP_SPAN = "sft_step#"  # the CPU span around each traced optimizer step
MEMORY_HISTORY_ENTRIES = 2_000_000  # allocations and frees kept: a 128k-token step makes ~2 x 10^4
REPO = Path(__file__).resolve().parents[1]

# First matching pattern wins; matched against the lower-cased kernel name.
KERNEL_CLASSES = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "wgmma")),
    ("optimizer", ("adam",)),
    ("compiled (triton)", ("triton",)),
    ("copies, casts, foreach", ("copy", "cat", "foreach", "elementwise", "vectorized", "reduce", "fill")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, patterns in KERNEL_CLASSES:
        if any(p in lowered for p in patterns):
            return label
    return "other"


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union of a) ∩ (union of b)."""
    return _union_length(a) + _union_length(b) - _union_length(a + b)


def summarize_trace(path: Path, top: int = 15) -> str:
    """A plain-text breakdown of the GPU kernels in a Chrome/Kineto trace (times per traced step)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    # The CPU spans (the GPU timeline repeats them as gpu_user_annotation).
    steps = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_SPAN)]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    num_steps = max(1, len(steps))
    if steps:
        wall = sum(e["dur"] for e in steps) / num_steps
    elif kernels:
        wall = (max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)) / num_steps
    else:
        wall = 0.0
    lines = [f"trace {path.name}: {len(steps)} profiled steps, {wall / 1e3:.1f} ms per step (wall)"]
    if not kernels:
        return "\n".join(lines + ["no GPU kernels in the trace (CPU run)"])

    per_class: dict[str, float] = {}
    per_kernel: dict[str, list[float]] = {}
    comm, compute = [], []
    for k in kernels:
        label = kernel_class(k["name"])
        per_class[label] = per_class.get(label, 0.0) + k["dur"]
        per_kernel.setdefault(k["name"], []).append(k["dur"])
        (comm if label == "nccl" else compute).append((k["ts"], k["ts"] + k["dur"]))
    compute_busy, comm_busy = _union_length(compute), _union_length(comm)
    comm_hidden = _overlap_length(compute, comm)
    lines += [
        f"compute kernels busy {compute_busy / num_steps / 1e3:8.1f} ms/step ({compute_busy / num_steps / wall:6.1%}"
        " of wall)",
        f"collectives busy     {comm_busy / num_steps / 1e3:8.1f} ms/step, of which under compute "
        f"{comm_hidden / num_steps / 1e3:.1f} ms; exposed {(comm_busy - comm_hidden) / num_steps / 1e3:.1f} ms",
        f"GPU idle (no kernel) {(wall - _union_length(compute + comm) / num_steps) / 1e3:8.1f} ms/step",
        "",
        "kernel time per step by class (sums; classes may overlap in time):",
    ]
    for label, total in sorted(per_class.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:24s} {total / num_steps / 1e3:8.1f} ms  {total / num_steps / wall:6.1%}")
    lines += ["", f"top {top} kernels by total time per step:"]
    for name, durations in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(durations) / num_steps / 1e3:8.2f} ms  {len(durations) / num_steps:6.0f}x  "
                     f"[{kernel_class(name)}] {name[:110]}")
    return "\n".join(lines)


def memory_by_stream(snapshot: dict) -> str:
    """Where the CUDA caching allocator's memory sits, per stream, from `torch.cuda.memory._snapshot()`:
    reserved (its segments), allocated, free (cached for that stream only: no other stream's
    allocation can use it without a retry) and the largest free block. The allocator's retries near
    the memory limit come from free memory in the wrong stream's pool or in pieces too small
    (issue #24); this says which."""
    streams: dict[int, dict[str, float]] = {}
    for segment in snapshot["segments"]:
        row = streams.setdefault(segment["stream"], {"segments": 0, "reserved": 0, "allocated": 0, "largest free": 0})
        row["segments"] += 1
        row["reserved"] += segment["total_size"]
        row["allocated"] += segment["allocated_size"]
        free = [b["size"] for b in segment["blocks"] if b["state"] == "inactive"]
        row["largest free"] = max([row["largest free"], *free])
    lines = ["caching allocator by stream (GiB; stream 0 is the default, compute stream):",
             "  stream              segments  reserved  allocated      free  largest free"]
    for stream, row in sorted(streams.items(), key=lambda kv: -kv[1]["reserved"]):
        gib = {key: value / 2**30 for key, value in row.items() if key != "segments"}
        lines.append(f"  {stream:<18d}  {row['segments']:8d}  {gib['reserved']:8.2f}  {gib['allocated']:9.2f}  "
                     f"{gib['reserved'] - gib['allocated']:8.2f}  {gib['largest free']:12.2f}")
    return "\n".join(lines)


def _is_ours(filename: str) -> bool:
    """Whether a frame is in this repository (train.py, sft/), not in an installed package."""
    return filename.startswith(str(REPO)) and "-packages/" not in filename


def _frame_label(frame: dict) -> str:
    """file:line function, the file from its package or repository root (torch/..., sft/...)."""
    path = frame["filename"]
    if _is_ours(path):
        path = str(Path(path).relative_to(REPO))
    elif "torchinductor" in path:  # inductor's generated code: its cache path says nothing
        path = "compiled " + Path(path).name
    else:
        for root in ("site-packages/", "dist-packages/"):
            path = path.split(root, 1)[-1]
    return f"{path}:{frame['line']} {frame['name']}"


def _allocation_site(frames: list[dict]) -> str:
    """Where an allocation came from: its innermost Python frame, and the innermost frame of this
    repository that led to it."""
    if not frames:  # the autograd engine runs eager backward ops and gradient accumulation in C++
        return "(no Python frame: C++, e.g. an eager op's backward)"
    inner = _frame_label(frames[0])
    ours = next((_frame_label(f) for f in frames if _is_ours(f["filename"])), None)
    return inner if ours is None or ours == inner else f"{inner}  <-  {ours}"


def memory_at_peak(snapshot: dict, requested_at_start: int, device: int = 0, top: int = 12,
                   capacity: int = MEMORY_HISTORY_ENTRIES) -> str:
    """What was alive at the highest point of allocated memory in the recorded history of
    `snapshot` (`torch.cuda.memory._snapshot()` with `_record_memory_history` on since
    `requested_at_start` bytes were requested, the allocator's "requested_bytes.all.current"),
    grouped by allocation site, largest first. Bytes count as the allocator's statistic does: up at
    an alloc, down at a free request, by the size each tensor asked for (the allocator rounds it up
    by at most 512 bytes with expandable segments). What was allocated before the recording
    started is one line. A history of `capacity` entries or more has wrapped: then only that is said."""
    trace = snapshot["device_traces"][device]
    if len(trace) >= capacity:
        return (f"memory at the peak: the allocation history wrapped ({len(trace)} entries, the most kept): "
                "trace fewer steps (logging.profile_steps)")
    events = [e for e in trace if e["action"] in ("alloc", "free_requested")]
    current, peak, peak_index = requested_at_start, requested_at_start, -1
    for index, event in enumerate(events):
        current += event["size"] if event["action"] == "alloc" else -event["size"]
        if current > peak:
            peak, peak_index = current, index
    live: dict[int, dict] = {}
    for event in events[:peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        site = sites[_allocation_site(event.get("frames") or [])]
        site[0] += event["size"]
        site[1] += 1
    recorded = sum(size for size, _ in sites.values())
    lines = [f"memory at its peak in the traced steps: {peak / 2**30:.2f} GiB requested "
             f"({len(events)} allocations and frees recorded)",
             "      GiB  tensors  allocated at",
             f"  {(peak - recorded) / 2**30:7.2f}  {'':>7}  "
             "(before the traced steps: parameters, optimizer state, ...)"]
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    for site, (size, count) in ranked[:top]:
        lines.append(f"  {size / 2**30:7.2f}  {count:7d}  {site}")
    if len(ranked) > top:
        rest = ranked[top:]
        lines.append(f"  {sum(size for _, (size, _) in rest) / 2**30:7.2f}  "
                     f"{sum(count for _, (_, count) in rest):7d}  ({len(rest)} other sites)")
    return "\n".join(lines)


class StepProfiler:
    """Records optimizer steps first..last (inclusive, 1-based; cut at the run's final step) on
    rank 0 with torch.profiler, then writes <out_dir>/trace-rank0.json.gz (chrome://tracing,
    Perfetto) and summary.txt, and hands the summary to `report` (a log function). On GPUs it also
    records the allocations from the first traced step to the end of the last (an eval or a save
    in between counts too; memory-rank0.pickle) and the summary ends with the allocator's memory by
    stream after the last traced step and what was alive at the peak."""

    def __init__(self, steps: tuple[int, int] | None, final_step: int, out_dir: Path, enabled: bool,
                 report: Callable[[str], None]):
        self.first, self.last = (steps[0], min(steps[1], final_step)) if steps and enabled else (0, -1)
        self.out_dir, self.report = out_dir, report
        self.profiler: torch.profiler.profile | None = None
        self.span: torch.profiler.record_function | None = None
        self.requested_at_start = 0

    def step_begins(self, step: int) -> None:
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            if torch.cuda.is_available():
                self.requested_at_start = torch.cuda.memory_stats()["requested_bytes.all.current"]
                torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                                         max_entries=MEMORY_HISTORY_ENTRIES, clear_history=True)
        if self.profiler is not None:
            self.span = torch.profiler.record_function(f"{STEP_SPAN}{step}")
            self.span.__enter__()

    def step_ends(self, step: int) -> None:
        """Close the step; after the last traced step, write the trace and report the summary."""
        if self.profiler is None:
            return
        self.span.__exit__(None, None, None)
        if step < self.last:
            return
        self.profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace-rank0.json"
        self.profiler.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(trace.with_suffix(".json.gz"), "wb") as dst:
            dst.writelines(src)
        trace.unlink()
        summary = summarize_trace(trace.with_suffix(".json.gz"))
        if torch.cuda.is_available():
            try:
                snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(None)
            with open(self.out_dir / "memory-rank0.pickle", "wb") as f:
                pickle.dump(snapshot, f)
            summary += ("\n\n" + memory_by_stream(snapshot)
                        + "\n\n" + memory_at_peak(snapshot, self.requested_at_start, torch.cuda.current_device()))
        (self.out_dir / "summary.txt").write_text(summary + "\n")
        self.profiler = None
        self.report(f"profile of steps ({self.first}, {self.last}) in {self.out_dir}:\n{summary}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a Chrome/Kineto trace (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=15, help="how many kernels to list")
    args = parser.parse_args()
    print(summarize_trace(args.trace, args.top))


if __name__ == "__main__":
    main()
