"""What users reach for: metrics.jsonl, progress, TensorBoard, the plot, chat, the run directory."""

import subprocess
import sys

import pytest

from helpers import REPO, read_metrics, run_torchrun

STEP_KEYS = {"step", "loss", "grad_norm", "lr", "tokens", "supervised_tokens", "tokens_seen", "step_time", "eta_s",
             "tokens_per_s_per_gpu", "supervised_tokens_per_s_per_gpu", "peak_memory_gib"}


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_data):
    """A short 2-rank demo run with TensorBoard, a profile of steps 4-5 and an HF export."""
    out = tmp_path_factory.mktemp("ux")
    proc = run_torchrun(["train.py", "--config", "configs/demo.yaml", f"data.path={demo_data / 'train.jsonl'}",
                         f"data.eval_path={demo_data / 'eval.jsonl'}", f"train.output_dir={out}",
                         "train.run_name=ux", f"data.cache_dir={out / 'cache'}", "train.max_steps=6",
                         "eval.every_steps=3", "logging.every_steps=2", "logging.tensorboard=true",
                         "logging.profile_steps=[4,5]"], nproc=2)
    return out / "ux", proc


def test_metrics_file_has_stable_keys_and_monotonic_steps(run):
    run_dir, _ = run
    entries = read_metrics(run_dir)
    steps = [e for e in entries if "loss" in e]
    evals = [e for e in entries if "eval_loss" in e]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in evals] == [0, 3, 6]
    for e in steps:
        assert STEP_KEYS <= e.keys()
    assert steps[0]["startup_s"] > 0 and len(steps[0]["host_peak_rss_gib_per_rank"]) == 2
    assert [e["tokens_seen"] for e in steps] == sorted({e["tokens_seen"] for e in steps})
    assert steps[-1]["eta_s"] == 0


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


def test_chat_answers_from_the_export(run):
    run_dir, _ = run
    proc = subprocess.run([sys.executable, "-m", "sft.chat", str(run_dir / "export"), "--prompt", "What is 2 + 2?",
                           "--max-new-tokens", "6"], cwd=REPO, check=True, capture_output=True, text=True)
    answer = proc.stdout.strip().splitlines()[-1]
    assert answer and "What is 2 + 2?" not in answer  # the reply only, not the prompt echoed back


def test_progress_bar_on_request(tmp_path, demo_data):
    proc = run_torchrun(["train.py", "--config", "configs/demo.yaml", f"data.path={demo_data / 'train.jsonl'}",
                         f"data.eval_path={demo_data / 'eval.jsonl'}", f"train.output_dir={tmp_path}", "train.run_name=bar", "train.max_steps=3",
                         "logging.progress=bar", "checkpoint.enabled=false", "checkpoint.export_hf=false"], nproc=1)
    assert "3/3" in proc.stderr and "step/s" in proc.stderr
    assert "| loss" not in proc.stdout  # the bar replaces the per-step lines


def test_profiled_steps_leave_a_trace_and_a_summary(run):
    run_dir, proc = run
    summary = (run_dir / "profile" / "summary.txt").read_text()
    assert summary.startswith("trace trace-rank0.json.gz: 2 profiled steps,")
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["summary.txt", "trace-rank0.json.gz"]
    assert "profile of steps (4, 5)" in proc.stdout
    assert [e["step"] for e in read_metrics(run_dir) if "loss" in e] == [1, 2, 3, 4, 5, 6]  # no step lost
