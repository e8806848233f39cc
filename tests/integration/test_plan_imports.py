"""The trainer's entry points in a Python of their own: what they load."""


import pytest

from helpers import REPO


@pytest.mark.slow  # a Python of its own: this one has imported the GPU side of the trainer
def test_the_planner_imports_nothing_of_the_trainer_s_gpu_side():
    """`python -m sft.plan` runs on login nodes: of the trainer it imports the rules (the config, the
    mesh, the table of checkpointing modes, the model's shapes), never FSDP's wrapping, float8,
    the checkpoint machinery or the training loop's parts. (transformers itself imports torch's
    FSDP, and torchao where it is installed, as soon as it builds any model.)"""
    import ast
    import subprocess
    import sys

    code = ("import sys; from sft.plan import main; main(['--config', 'configs/qwen72b.yaml', '--gpus', '64']); "
            "print(sorted(m for m in sys.modules if m.startswith('sft.')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(proc.stdout.splitlines()[-1]))
    assert "sft.parallel.activation_checkpointing" in loaded and "sft.parallel.mesh" in loaded
    gpu_side = {"sft.parallel.fsdp", "sft.parallel.parallelize", "sft.parallel.float8", "sft.hub.weights",
                "sft.training.loss", "sft.parallel.context_parallel", "sft.parallel.expert_parallel", "sft.training.model",
                "sft.checkpoint.manager", "sft.checkpoint.commit", "sft.checkpoint.staging", "sft.training.metrics",
                "sft.training.evaluate", "sft.data.batches", "sft.data.prepare"}
    assert not loaded & gpu_side, loaded & gpu_side


@pytest.mark.slow  # a Python of its own: this one has imported peft
def test_train_py_imports_neither_transformers_trainer_nor_peft():
    """transformers' trainer utilities (set_seed, the schedules' module) import peft where it is installed:
    9.6 s of a launch's 15 s of imports on an H200 host. train.py's imports load neither."""
    import subprocess
    import sys

    code = "import sys, train; print(sorted(m for m in ('peft', 'transformers.trainer_utils') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout
