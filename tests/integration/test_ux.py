"""What users reach for: metrics.jsonl, progress, TensorBoard, the plot, chat, the run directory."""

import re
import subprocess
import sys

import pytest
import torch

from helpers import REPO, run_demo
from sft.training.metrics import ALLOCATOR_KEYS, START_KEYS, STEP_KEYS, AllocatorStats, format_step, read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_data):
    """A short 2-rank demo run with TensorBoard, a profile of steps 4-5 and an HF export."""
    out = tmp_path_factory.mktemp("ux")
    proc = run_demo(demo_data, out, "ux", "train.max_steps=6", "eval.every_steps=3", "logging.every_steps=2",
                    "logging.tensorboard=true", "logging.profile_steps=[4,5]", nproc=2)
    return out / "ux", proc


def test_metrics_file_has_stable_keys_and_monotonic_steps(run):
    run_dir, _ = run
    by_step, evals = read_metrics(run_dir)
    assert list(by_step) == [1, 2, 3, 4, 5, 6]  # in file order, each step once
    assert list(evals) == [0, 3, 6]
    steps = list(by_step.values())
    for e in steps:
        assert set(e) == set(STEP_KEYS) | (set(START_KEYS) if e["step"] == 1 else set())  # no MFU on CPU
    assert steps[0]["startup_s"] > 0 and len(steps[0]["host_peak_rss_gib_per_rank"]) == 2
    stages = steps[0]["startup_stages_s"]  # where the start went, in order; the rest is making the metrics
    assert list(stages) == ["imports", "setup", "data", "model", "weights"] and min(stages.values()) > 0
    assert sum(stages.values()) <= steps[0]["startup_s"] < sum(stages.values()) + 5
    # and one line, once the first step is done: the stages and the step
    line = re.search(r"start-up and step 1 took ([\d.]+) s: imports ([\d.]+) s, setup [\d.]+ s, "
                     r"data [\d.]+ s, model [\d.]+ s, weights [\d.]+ s, step 1 ([\d.]+) s", run[1].stdout)
    assert line and float(line[1]) == pytest.approx(steps[0]["startup_s"] + float(line[3]), abs=0.11), line
    assert [e["tokens_seen"] for e in steps] == sorted({e["tokens_seen"] for e in steps})
    assert steps[-1]["eta_s"] == 0


def test_readme_documents_exactly_the_metrics_keys():
    table = (REPO / "docs" / "checkpoints.md").read_text().split("| `metrics.jsonl` |")[1].split("\n")[0]
    documented = set(table.split("`")[1].split(", "))  # the first `...` lists the per-step keys
    assert documented == set(STEP_KEYS)
    assert all(f"`{key}`" in table for key in ("mfu", *ALLOCATOR_KEYS, *START_KEYS))


def test_allocator_retries_are_counted_per_step(monkeypatch):
    """On GPUs each step logs the allocator's peak reserved memory and the retries of that step (the
    allocator's counter is cumulative); on CPU only peak_memory_gib, 0."""
    stats = iter([{"num_alloc_retries": 3, "reserved_bytes.all.peak": 70 * 2**30, "allocated_bytes.all.peak": 2**32},
                  {"num_alloc_retries": 3, "reserved_bytes.all.peak": 70 * 2**30, "allocated_bytes.all.peak": 2**31},
                  {"num_alloc_retries": 5, "reserved_bytes.all.peak": 72 * 2**30, "allocated_bytes.all.peak": 2**31}])
    resets = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: next(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    allocator = AllocatorStats(torch.device("cuda", 0))
    steps = [allocator.step() for _ in range(3)]
    assert [s["alloc_retries"] for s in steps] == [3, 0, 2]
    assert [s["peak_reserved_gib"] for s in steps] == [70.0, 70.0, 72.0]
    assert [s["peak_memory_gib"] for s in steps] == [4.0, 2.0, 2.0]
    assert len(resets) == 3  # each step's peaks are its own
    assert set(steps[0]) == {"peak_memory_gib", *ALLOCATOR_KEYS}
    assert AllocatorStats(torch.device("cpu")).step() == {"peak_memory_gib": 0.0}
    entry = {"step": 3, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-5, "tokens_per_s_per_gpu": 1e4, "step_time": 1.0,
             "eta_s": 0, **steps[2]}
    assert format_step(entry, 3).endswith("| 2 allocator retries | 1.00 s/step | ETA 0:00:00")


def test_plain_log_lines_without_a_terminal(run):
    _, proc = run
    lines = [line for line in proc.stdout.splitlines() if "| loss" in line]
    assert [line.split("step ")[1].split("/")[0] for line in lines] == ["2", "4", "6"]  # logging.every_steps=2
    assert "it/s]" not in proc.stderr and "step/s]" not in proc.stderr and "\r" not in proc.stdout


def test_tensorboard_scalars_are_written(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = run
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("eval_loss")] == [0, 3, 6]


def test_run_directory_layout(run):
    run_dir, _ = run
    for path in ("config.yaml", "metrics.jsonl", "tb", "finished", "checkpoints/latest", "checkpoints/step-6",
                 "export/config.json", "export/model.safetensors.index.json", "export/tokenizer.json"):
        assert (run_dir / path).exists(), path


def test_plot_writes_a_png(run):
    run_dir, _ = run
    subprocess.run([sys.executable, "-m", "sft.plot", str(run_dir)], cwd=REPO, check=True, capture_output=True)
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_on_request(tmp_path, demo_data):
    proc = run_demo(demo_data, tmp_path, "bar", "train.max_steps=3", "logging.progress=bar", "checkpoint.enabled=false",
                    "checkpoint.export_hf=false")
    assert "3/3" in proc.stderr and "step/s" in proc.stderr
    assert "| loss" not in proc.stdout  # the bar replaces the per-step lines


def test_profiled_steps_leave_a_trace_and_a_summary(run):
    run_dir, proc = run
    summary = (run_dir / "profile" / "summary.txt").read_text()
    assert summary.startswith("trace trace-rank0.json.gz: 2 profiled steps,")
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["summary.txt", "trace-rank0.json.gz"]
    assert "profile of steps (4, 5)" in proc.stdout
    assert list(read_metrics(run_dir)[0]) == [1, 2, 3, 4, 5, 6]  # no step lost
