"""train.py end to end on CPU: compile does not recompile, packing (the README's demo: tests/integration/test_demo.py)."""

import re
from collections import Counter

import pytest

from helpers import eval_losses, run_demo
from sft.training.metrics import read_metrics


def first_step_graphs(stdout: str) -> tuple[int, int]:
    """(graphs from the cache, graphs compiled) as the log's first-step line says."""
    found = re.search(r"torch\.compile: (\d+) graphs from the cache, (\d+) compiled", stdout)
    assert found, stdout[-3000:]
    return int(found[1]), int(found[2])


@pytest.mark.slow
@pytest.mark.parametrize("ac_mode", ["blocks", "ops_half"])  # op-level: its policy is traced into the graph
def test_compiled_blocks_do_not_recompile_on_variable_lengths(tmp_path, demo_data, ac_mode):
    compiled = ["compile.enabled=true", "ac.ratio=0.5", f"ac.mode={ac_mode}", "train.micro_batch_size=4",
                "eval.every_steps=0", f"compile.cache_dir={tmp_path / 'cache'}"]
    proc = run_demo(demo_data, tmp_path, "compiled", *compiled, "train.max_steps=12", env={"TORCH_LOGS": "recompiles"})
    recompiles = Counter(line.split("Recompiling function ")[1] for line in proc.stderr.splitlines()
                         if "Recompiling function" in line)
    # Two compiled functions (checkpointed and plain blocks); each recompiles at most twice: once
    # to dynamic lengths (at the second shape it sees) and once for grad mode (eval runs under
    # no_grad); none during the 12 training steps of varying length.
    assert 1 <= len(recompiles) <= 2 and max(recompiles.values()) <= 2, recompiles
    assert "size mismatch" in proc.stderr  # lengths did vary
    assert f"applied activation checkpointing ({ac_mode}) to 2/4 blocks: [0, 2]" in proc.stdout
    steps, _ = read_metrics(tmp_path / "compiled")
    assert sorted(steps) == list(range(1, 13))
    assert f"compile caches: {tmp_path / 'cache'}" in proc.stdout
    assert first_step_graphs(proc.stdout)[1] >= 2  # a fresh cache: the first two steps' graphs compiled
    if ac_mode == "blocks":  # a relaunch (a requeue, a new run of these shapes) compiles nothing of them again
        again = run_demo(demo_data, tmp_path, "relaunched", *compiled, "train.max_steps=2")
        from_cache, compiled_again = first_step_graphs(again.stdout)
        assert compiled_again == 0 and from_cache >= 2, again.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("ac", [[], ["ac.ratio=1", "ac.mode=ops"]], ids=["no AC", "op-level AC"])
def test_packing_is_a_yaml_switch(tmp_path, demo_data, ac):
    proc = run_demo(demo_data, tmp_path, "packed", "data.packing=true", "train.micro_batch_size=2",
                    "train.max_steps=12", "eval.every_steps=0", *ac, nproc=2)
    assert "packed into" in proc.stdout
    steps, _ = read_metrics(tmp_path / "packed")
    assert len(steps) == 12 and steps[12]["loss"] < steps[1]["loss"]
    evals = eval_losses(tmp_path / "packed")
    assert evals[-1] < evals[0]
