"""Context parallelism end to end (train.py on 2 gloo ranks): cp 2 trains as cp 1 on the same global
batches, and a checkpoint resumes at another degree. The gradient tables (cp 2 and 4 vs the
single-process Hugging Face reference, packed and padded) and the leakage probe are in
test_distributed.py; the head-tail split and the masks: tests/unit/test_context_parallel.py."""

import shutil

import pytest

from helpers import eval_losses, run_demo, train_losses

from sft.training.metrics import read_metrics


# (run, ranks, cp.degree): the same global batch of 8 packed rows (micro-batch 2 x grad-accum 4 x
# ranks / cp.degree = 1 data-parallel rank).
LAYOUTS = [("cp1", 1, 1), ("cp2", 2, 2)]


def demo_cp(data, out, name, nproc, cp):
    return run_demo(data, out, name, "data.packing=true", "train.max_steps=20", "train.micro_batch_size=2",
                    "train.grad_accum_steps=4", f"cp.degree={cp}", "eval.every_steps=10",
                    "checkpoint.every_steps=10", "checkpoint.export_hf=false", nproc=nproc)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, demo_data):
    out = tmp_path_factory.mktemp("cp")
    for name, nproc, cp in LAYOUTS:
        demo_cp(demo_data, out, name, nproc, cp)
    return out


@pytest.mark.slow
def test_cp2_trains_as_cp1(layouts):
    """20 steps of packed rows: every step's loss and grad norm agree (only summation orders differ),
    and each token is counted once (tokens, supervised tokens, eval)."""
    one, two = train_losses(layouts / "cp1"), train_losses(layouts / "cp2")
    assert sorted(one) == sorted(two) == list(range(1, 21))
    for step, (loss, norm) in one.items():
        assert two[step][0] == pytest.approx(loss, rel=1e-5)
        assert two[step][1] == pytest.approx(norm, rel=1e-4)
    assert eval_losses(layouts / "cp2") == pytest.approx(eval_losses(layouts / "cp1"), rel=1e-5)
    (steps1, _), (steps2, _) = read_metrics(layouts / "cp1"), read_metrics(layouts / "cp2")
    for step, entry in steps1.items():
        assert (steps2[step]["tokens"], steps2[step]["supervised_tokens"]) == (entry["tokens"], entry["supervised_tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("source, nproc, cp", [("cp1", 2, 2), ("cp2", 1, 1)], ids=["cp1 -> cp2", "cp2 -> cp1"])
def test_checkpoint_resumes_at_another_cp_degree(layouts, demo_data, source, nproc, cp):
    name = f"{source}-resumed-at-cp{cp}"
    target = layouts / name / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(layouts / source / "checkpoints" / "step-10", target / "step-10")
    proc = demo_cp(demo_data, layouts, name, nproc, cp)
    assert f"resumed from {target / 'step-10'} (step 10" in proc.stdout
    resumed, reference = train_losses(layouts / name), train_losses(layouts / source)
    assert sorted(resumed) == list(range(11, 21))
    for step, (loss, norm) in resumed.items():
        assert loss == pytest.approx(reference[step][0], rel=1e-5)
        assert norm == pytest.approx(reference[step][1], rel=1e-4)
