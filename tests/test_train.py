"""train.py end to end on CPU: the demo learns, compile does not recompile, runs are not clobbered."""

import subprocess
from collections import Counter
import sys

import pytest

from helpers import REPO, read_metrics, run_torchrun


@pytest.fixture(scope="module")
def full_demo_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_full")
    subprocess.run([sys.executable, str(REPO / "scripts" / "demo_data.py"), "--out", str(out)], check=True)
    return out


def demo_args(data, out, name, *overrides):
    return ["train.py", "--config", "configs/demo.yaml", f"data.path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'eval.jsonl'}", f"train.output_dir={out}", f"train.run_name={name}",
            f"data.cache_dir={out / 'cache'}", *overrides]


def test_demo_learns_on_two_ranks(tmp_path, full_demo_data):
    """The shipped demo config under torchrun with 2 ranks (FSDP2, gloo): held-out loss halves."""
    proc = run_torchrun(demo_args(full_demo_data, tmp_path, "demo"), nproc=2)
    evals = [m["eval_loss"] for m in read_metrics(tmp_path / "demo") if "eval_loss" in m]
    assert evals[-1] <= 0.5 * evals[0], evals
    assert "lower)" in proc.stdout and (tmp_path / "demo" / "finished").exists()
    assert (tmp_path / "demo" / "config.yaml").read_text().startswith("model:")


def test_compiled_blocks_do_not_recompile_on_variable_lengths(tmp_path, demo_data):
    proc = run_torchrun(demo_args(demo_data, tmp_path, "compiled", "compile.enabled=true", "ac.ratio=0.5",
                                  "train.micro_batch_size=4", "train.max_steps=24", "eval.every_steps=0"),
                        nproc=1, env={"TORCH_LOGS": "recompiles"})
    recompiles = Counter(line.split("Recompiling function ")[1] for line in proc.stderr.splitlines()
                         if "Recompiling function" in line)
    # Two compiled functions (checkpointed and plain blocks); each recompiles at most twice: once
    # to dynamic lengths (at the second shape it sees) and once for grad mode (eval runs under
    # no_grad); none during the 24 training steps of varying length.
    assert 1 <= len(recompiles) <= 2 and max(recompiles.values()) <= 2, recompiles
    assert "size mismatch" in proc.stderr  # lengths did vary
    steps = [m for m in read_metrics(tmp_path / "compiled") if "loss" in m]
    assert len(steps) == 24


def test_finished_run_is_not_overwritten(tmp_path, demo_data):
    args = demo_args(demo_data, tmp_path, "once", "train.max_steps=1", "train.overwrite=false")
    run_torchrun(args, nproc=1)
    proc = run_torchrun(args, nproc=1, check=False)
    assert proc.returncode != 0
    assert "holds a finished run; set train.overwrite=true" in proc.stderr


def test_packing_is_a_yaml_switch(tmp_path, demo_data):
    proc = run_torchrun(demo_args(demo_data, tmp_path, "packed", "data.packing=true", "train.micro_batch_size=2",
                                  "train.max_steps=12", "eval.every_steps=0"), nproc=2)
    assert "packed into" in proc.stdout
    steps = [m for m in read_metrics(tmp_path / "packed") if "loss" in m]
    assert len(steps) == 12 and steps[-1]["loss"] < steps[0]["loss"]
    evals = [m["eval_loss"] for m in read_metrics(tmp_path / "packed") if "eval_loss" in m]
    assert evals[-1] < evals[0]
