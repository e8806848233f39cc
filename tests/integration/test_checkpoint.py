"""Checkpoints: exact resume, resharding, crash safety, preemption, Hugging Face export."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (REPO, demo_args, eval_losses, hf_eval_loss, one_entry_per_step, run_demo, run_torchrun, start_in_background,
                     train_losses as train_steps, wait_for_step, with_test_hooks)
from sft.checkpoint.layout import checkpoint_problem, content_problem
from sft.training.preemption import LAUNCHER_GONE, REQUEUE_EXIT_CODE

pytestmark = pytest.mark.slow


def demo(data, out, name, *overrides):
    return demo_args(data, out, name, "eval.every_steps=0", *overrides)


@pytest.fixture(scope="module")
def continuous(tmp_path_factory, demo_data):
    """6 steps on 2 ranks, data shuffled (fp32), checkpoints at 2 and 4 (asynchronous: the second
    reuses the first one's staging buffers) and 6 (the final save, synchronous); keep_last 2."""
    out = tmp_path_factory.mktemp("ckpt")
    run_demo(demo_data, out, "continuous", "eval.every_steps=0", "train.max_steps=6", "checkpoint.every_steps=2",
             "train.micro_batch_size=4", nproc=2)
    return out


def resume_from_step4(continuous, demo_data, name, nproc, *overrides):
    target = continuous / name / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(continuous / "continuous" / "checkpoints" / "step-4", target / "step-4")
    proc = run_demo(demo_data, continuous, name, "eval.every_steps=0", "train.max_steps=6",
                    "checkpoint.every_steps=2", *overrides, nproc=nproc)
    assert f"resumed from {target / 'step-4'} (step 4, saved by 2 ranks) in" in proc.stdout
    return train_steps(continuous / name)


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(continuous, demo_data):
    reference = train_steps(continuous / "continuous")
    resumed = resume_from_step4(continuous, demo_data, "resumed", 2, "train.micro_batch_size=4")
    assert sorted(resumed) == [5, 6]
    for step, values in resumed.items():
        assert values == reference[step]  # exact: same ranks, same data order, same RNG


def test_two_rank_checkpoint_resumes_on_one_rank(continuous, demo_data):
    """DCP reshards model and optimizer; the same global batch (4 x 2 ranks = 4 x 2 grad-acc)
    keeps the data order; only the reduction order differs."""
    reference = train_steps(continuous / "continuous")
    resumed = resume_from_step4(continuous, demo_data, "one_rank", 1, "train.micro_batch_size=4",
                                "train.grad_accum_steps=2")
    for step, (loss, norm) in resumed.items():
        assert loss == pytest.approx(reference[step][0], rel=1e-5)
        assert norm == pytest.approx(reference[step][1], rel=1e-4)


def test_interrupted_or_truncated_checkpoints_are_skipped(continuous, demo_data):
    """What a kill -9 during a save leaves (a step-N.tmp folder) is ignored; a committed but
    truncated checkpoint that `latest` names is skipped for the previous good one."""
    run = continuous / "damaged"
    shutil.copytree(continuous / "continuous" / "checkpoints", run / "checkpoints")
    (run / "checkpoints" / "step-9.tmp").mkdir()
    (run / "checkpoints" / "step-9.tmp" / "__0_0.distcp").write_bytes(b"partial")
    shard = next((run / "checkpoints" / "step-6").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run_demo(demo_data, continuous, "damaged", "eval.every_steps=0", "train.max_steps=6",
                    "train.micro_batch_size=4", nproc=2)
    assert "skipping" in proc.stdout and "is missing or truncated" in proc.stdout, proc.stdout
    assert "resumed from" in proc.stdout and "step-4 (step 4" in proc.stdout
    assert sorted(train_steps(run)) == [5, 6]
    assert not (run / "checkpoints" / "step-9.tmp").exists()  # cleaned once a new save committed
    assert (run / "checkpoints" / "latest").read_text() == "step-6\n"

    # Naming the truncated checkpoint explicitly is one clear error, not a crash loop.
    bad = continuous / "bad"
    shutil.copytree(continuous / "continuous" / "checkpoints" / "step-6", bad)
    next(bad.glob("*.distcp")).unlink()
    proc = subprocess.run([sys.executable, *demo(demo_data, continuous, "explicit", f"checkpoint.resume={bad}")],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    assert f"checkpoint.resume='{bad}' is not a usable checkpoint: data file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_corrupt_shard_of_the_right_size_falls_back_to_the_previous_checkpoint(continuous, demo_data):
    """Random bytes over a data file pass every size check, not its digest: the resume takes step-4
    with one line naming the file, and step-6 waits in damaged/ instead of failing every requeue."""
    reference = train_steps(continuous / "continuous")
    run = continuous / "corrupt"
    shutil.copytree(continuous / "continuous" / "checkpoints", run / "checkpoints")
    for step in ("step-4", "step-6"):  # the asynchronous and the final synchronous save
        written = json.loads((run / "checkpoints" / step / "digests.json").read_text())
        assert sorted(written) == sorted(str(p.relative_to(run / "checkpoints" / step))
                                         for p in (run / "checkpoints" / step).rglob("*") if p.is_file()
                                         and p.name != "digests.json")
    shard = sorted((run / "checkpoints" / "step-6").glob("*.distcp"))[1]
    garbage = os.urandom(shard.stat().st_size)
    shard.write_bytes(garbage)
    assert checkpoint_problem(shard.parent) is None  # sizes and parses: all it can see
    proc = run_demo(demo_data, continuous, "corrupt", "eval.every_steps=0", "train.max_steps=6",
                    "train.micro_batch_size=4", nproc=2)
    assert (f"checkpoint: skipping {shard.parent} ({shard.name} differs from its digest (damaged after it was "
            "written))") in proc.stdout, proc.stdout.splitlines()[:12]
    assert f"resumed from {run / 'checkpoints' / 'step-4'} (step 4" in proc.stdout
    assert train_steps(run) == {5: reference[5], 6: reference[6]}
    assert (run / "damaged" / "checkpoints" / "step-6" / shard.name).read_bytes() == garbage


def test_a_damaged_digests_file_is_named(continuous, tmp_path):
    step = shutil.copytree(continuous / "continuous" / "checkpoints" / "step-6", tmp_path / "step-6")
    assert content_problem(step) is None
    (step / "digests.json").write_text('{"__0_0.distcp": ')  # cut short
    assert content_problem(step).startswith("unreadable digests.json (JSONDecodeError: ")
    (step / "digests.json").write_text('["crc32:0"]')
    assert content_problem(step) == "unreadable digests.json (not a mapping of file names to digests)"


def test_a_checkpoint_missing_a_ranks_rng_state_is_damaged(continuous, tmp_path):
    step = shutil.copytree(continuous / "continuous" / "checkpoints" / "step-6", tmp_path / "step-6")
    assert checkpoint_problem(step) is None
    (step / "rng-rank1.pt").unlink()  # rank 1 would resume with a fresh RNG
    assert checkpoint_problem(step) == "missing rng-rank1.pt"


def _workers(launcher: int) -> list[int]:
    """The train.py processes whose parent is `launcher`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == launcher and b"train.py" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, ValueError):  # a process that ended while we looked
            pass
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.time() + seconds
    while any(_running(pid) for pid in pids):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


# The moments of a launch at which its torchrun is killed (kill -9 of its process group: a
# supervisor, Ctrl-\): (test hooks that hold the workers there, the mark they leave when they are,
# whether the workers stop with a checkpoint). Before training began they end at once (nothing was
# trained); after, at the end of the step, with a checkpoint.
LAUNCHER_KILLS = {
    "before the rendezvous": ({"SFT_TEST_SLOW_RENDEZVOUS_S": "60"}, "rendezvous.rank1", False),
    "while rank 0 tokenises, rank 1 waiting for it": ({"SFT_TEST_SLOW_TOKENIZE_S": "60"}, "tokenising.rank0", False),
    "after the first step": ({"SFT_TEST_SLOW_STEP_S": "1"}, None, True),
}


@pytest.mark.parametrize("moment", list(LAUNCHER_KILLS))
def test_workers_stop_when_their_launcher_is_killed(continuous, demo_data, tmp_path, moment):
    """Each worker has a session of its own, so killing torchrun's group does not reach them: they
    notice their launcher is gone and stop within seconds at any moment of the launch, releasing the
    run; the same command then trains on (or resumes) bit for bit as the uninterrupted run."""
    hooks, mark, checkpointed = LAUNCHER_KILLS[moment]
    reference = train_steps(continuous / "continuous")
    args = demo(demo_data, tmp_path, "orphaned", "train.max_steps=6", "checkpoint.every_steps=2",
                "train.micro_batch_size=4")
    proc = start_in_background(args, nproc=2, env=with_test_hooks(SFT_TEST_MARKS=str(tmp_path), **hooks),
                               new_session=True)
    run = tmp_path / "orphaned"
    if mark:
        deadline = time.time() + 120
        while not (tmp_path / mark).exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
    else:
        wait_for_step(proc, run, 1)
    workers = _workers(proc.pid)
    assert len(workers) == 2, workers
    os.killpg(proc.pid, signal.SIGKILL)
    assert _gone_within(workers, 30), (moment, workers)
    stdout, stderr = proc.communicate(timeout=60)  # the workers held its pipes
    if checkpointed:
        stopped = json.loads((run / "stopped").read_text())
        # step 1 is logged while step 2 runs (metrics are read a step late, train.py), the kill comes
        # during step 2 or 3, and its stop flag is read in the step after: at most step 4
        assert stopped["signal"] == LAUNCHER_GONE and 1 <= stopped["step"] <= 4, (stopped, stdout[-2000:], stderr[-2000:])
        resumed_from = stopped["step"]
    else:
        errors = [line for line in stderr.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and "is gone, before this launch's first training step" in errors[0], stderr[-3000:]
        assert "Traceback" not in stderr and not run.exists(), stderr[-3000:]
        resumed_from = 0
    assert not (tmp_path / ".orphaned.lock").exists() or not checkpointed  # a killed process leaves it; reused
    rerun = run_demo(demo_data, tmp_path, "orphaned", *args[args.index("eval.every_steps=0"):], nproc=2)
    if resumed_from:
        assert f"(step {resumed_from}, saved by 2 ranks)" in rerun.stdout
    assert train_steps(run) == {step: reference[step] for step in range(1, 7)}
    assert one_entry_per_step(run)


def test_sigusr1_to_torchrun_stops_with_a_checkpoint(tmp_path, demo_data):
    """torchrun started as the README says forwards SIGUSR1 (without --signals-to-handle it dies
    of it and orphans the workers)."""
    proc = start_in_background(demo(demo_data, tmp_path, "usr1", "train.max_steps=1000"), nproc=2,
                               env=with_test_hooks(SFT_TEST_SLOW_STEP_S="0.5"))
    wait_for_step(proc, tmp_path / "usr1", 1)
    proc.send_signal(signal.SIGUSR1)
    stdout, _ = proc.communicate(timeout=120)
    stopped = json.loads((tmp_path / "usr1" / "stopped").read_text())
    assert stopped["signal"] == "SIGUSR1" and f"stopping at step {stopped['step']} on SIGUSR1" in stdout
    assert (tmp_path / "usr1" / "checkpoints" / "latest").read_text() == f"step-{stopped['step']}\n"


# How slurm/train.slurm asks a run to stop: the stop-request file (time limit), or SIGTERM through
# torchrun with TORCH_ELASTIC_SHUTDOWN_TIMEOUT (preemption). Either way the stop-save gets its
# time: (environment, seconds each save is slowed by). Through torchrun it takes 32 s, past
# torchrun's default 30 s before SIGKILL; the file involves no signal, so 4 s make it slow enough.
STOP_WAYS = {"stop-request file": ({}, 4), "SIGTERM": ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}, 32)}


@pytest.mark.parametrize("how", list(STOP_WAYS))
def test_a_slow_stop_save_commits_and_asks_for_requeue(tmp_path, demo_data, how):
    proc = start_in_background(demo(demo_data, tmp_path, "preempted", "train.max_steps=1000"), nproc=2,
                               env={**with_test_hooks(SFT_TEST_SLOW_SAVE_S=str(STOP_WAYS[how][1])), **STOP_WAYS[how][0]})
    run = tmp_path / "preempted"
    wait_for_step(proc, run, 2)
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the workers
    else:
        (run / "stop-request").write_text("")
    stdout, stderr = proc.communicate(timeout=240)
    latest = (run / "checkpoints" / "latest").read_text().strip()
    step = int(latest.removeprefix("step-"))
    assert step >= 2 and f"stopping at step {step} on {'SIGTERM' if how == 'SIGTERM' else 'stop-request'}" in stdout
    assert f"exit code {REQUEUE_EXIT_CODE}" in stdout
    assert json.loads((run / "stopped").read_text())["step"] == step  # what the Slurm script requeues on
    assert not (run / "stop-request").exists()  # it has done its work
    assert proc.returncode != 0  # torchrun reports the stop as a failure, never as success

    # The requeued job (same command) continues where it stopped.
    rerun = run_demo(demo_data, tmp_path, "preempted", "eval.every_steps=0", f"train.max_steps={step + 2}", nproc=2)
    assert f"(step {step}, saved by 2 ranks)" in rerun.stdout
    assert sorted(s for s in train_steps(run) if s > step) == [step + 1, step + 2]
    assert not (run / "stopped").exists()  # running again


def test_a_stop_requested_during_a_step_comes_after_the_next_one(tmp_path, demo_data):
    """The loop reads a step's metrics, and the stop flag that rides with them, once the next step's
    work is queued (train.py): a stop requested during step 3 stops the run after step 4, whose
    checkpoint records step 4's tokens seen; every step is logged once, in order."""
    run = tmp_path / "stopped"
    proc = start_in_background(demo(demo_data, tmp_path, "stopped", "train.max_steps=1000"), nproc=None,
                               env=with_test_hooks(SFT_TEST_STOP_REQUEST_AT=f"3:{run / 'stop-request'}"))
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == REQUEUE_EXIT_CODE, stderr[-3000:]
    assert "stopping at step 4 on stop-request" in stdout
    assert json.loads((run / "stopped").read_text())["step"] == 4
    assert (run / "checkpoints" / "latest").read_text() == "step-4\n"
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 3, 4] and one_entry_per_step(run)
    state = json.loads((run / "checkpoints" / "step-4" / "train_state.json").read_text())
    assert state["tokens_seen"] == steps[-1]["tokens_seen"] > steps[-2]["tokens_seen"]


def test_rank0_tokenising_longer_than_the_collective_timeout_still_starts(tmp_path, demo_data):
    """dist.timeout_minutes=0.15 (9 s) while rank 0 tokenises for 14 s: the other rank waits outside
    the collective timeout, and the run trains."""
    run_demo(demo_data, tmp_path, "slow", "dist.timeout_minutes=0.15", "train.max_steps=2", "eval.every_steps=0",
             "data.eval_path=null", "checkpoint.enabled=false", "checkpoint.export_hf=false", nproc=2,
             env=with_test_hooks(SFT_TEST_SLOW_TOKENIZE_S="14"))
    assert sorted(train_steps(tmp_path / "slow")) == [1, 2]


def test_sigterm_without_torchrun_exits_with_the_requeue_code(tmp_path, demo_data):
    proc = start_in_background(demo(demo_data, tmp_path, "single", "train.max_steps=1000"), nproc=None)
    wait_for_step(proc, tmp_path / "single", 1)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=120)
    assert proc.returncode == REQUEUE_EXIT_CODE
    assert (tmp_path / "single" / "checkpoints" / "latest").is_file()


def test_export_loads_in_transformers_with_the_trained_model(tmp_path, demo_data):
    """The exported model, loaded by from_pretrained, gives the same held-out loss (HF's own loss
    on the eval set) as the FSDP model's last eval; the tied embedding stays tied. A checkpoint
    exports again after the original model directory is gone, to the same bytes."""
    from transformers import AutoModelForCausalLM

    model_dir = shutil.copytree(REPO / "configs" / "demo" / "model", tmp_path / "model")
    args = demo(demo_data, tmp_path, "exported", "train.max_steps=5", "checkpoint.export_hf=true",
                "checkpoint.export_dtype=float32", f"model.name_or_path={model_dir}")
    run_torchrun(args, nproc=2)
    final_eval = eval_losses(tmp_path / "exported")[-1]
    shutil.rmtree(model_dir)
    again = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "sft.export", str(tmp_path / "exported" / "checkpoints" / "step-5"),
                    str(again), "--dtype", "float32"], cwd=REPO, check=True, capture_output=True)
    shard = "model-00001-of-00001.safetensors"
    assert (again / shard).read_bytes() == (tmp_path / "exported" / "export" / shard).read_bytes()

    model = AutoModelForCausalLM.from_pretrained(again)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert hf_eval_loss(model, demo_data, again) == pytest.approx(final_eval, rel=1e-5)


def test_prepared_model_cache_is_written_once_and_reused(tmp_path, demo_data):
    """The first run writes the loaded fp32 model as DCP; a later run (other seed, other world
    size) starts from it: same initial eval loss although its own random init would differ."""
    cache = tmp_path / "prepared"
    first = run_demo(demo_data, tmp_path, "first", "train.max_steps=1", f"model.prepared_cache={cache}", nproc=2)
    assert f"wrote the prepared-model cache {cache}" in first.stdout and (cache / ".metadata").is_file()
    written = [p.name for p in cache.iterdir()]
    second = run_demo(demo_data, tmp_path, "second", "train.max_steps=1", "train.seed=7",
                      f"model.prepared_cache={cache}")
    assert f"loaded the prepared-model cache {cache}" in second.stdout
    initial = [eval_losses(tmp_path / run)[0] for run in ("first", "second")]
    assert initial[1] == pytest.approx(initial[0], rel=1e-6)
    run_demo(demo_data, tmp_path, "fresh", "train.max_steps=1", "train.seed=7")
    assert eval_losses(tmp_path / "fresh")[0] != initial[0]
    # A LoRA run reads the base from it (adapters from their own init: B = 0, so the model is the
    # base in bf16; seed 7, whose own random init differs) and leaves it as it was (a cache of its
    # adapters failed a later run of another lora.rank on their shapes).
    lora = run_demo(demo_data, tmp_path, "lora", "train.max_steps=1", "train.seed=7", "lora.rank=8",
                    "fsdp.param_dtype=bfloat16", f"model.prepared_cache={cache}")
    assert f"loaded the prepared-model cache {cache}" in lora.stdout
    assert eval_losses(tmp_path / "lora")[0] == pytest.approx(initial[0], rel=1e-3)
    assert sorted(p.name for p in cache.iterdir()) == sorted(written)


def test_every_eval_is_logged_once_across_a_stop_on_an_eval_step_and_a_kill_during_the_export(tmp_path, demo_data):
    """A stop decided at step 4, an eval step (requested during step 3), loses no evaluation: the
    relaunch evaluates step 4 first. The relaunch's export is killed (-9) half-written; the next
    relaunch resumes at the final step, evaluates nothing again and exports, over what the kill
    left. Evaluations at 0, 4 and 8, each once; the losses those of an uninterrupted run."""
    run = tmp_path / "evals"
    args = demo_args(demo_data, tmp_path, "evals", "train.max_steps=8", "eval.every_steps=4", "checkpoint.export_hf=true")
    stopped = start_in_background(args, nproc=None,
                                  env=with_test_hooks(SFT_TEST_STOP_REQUEST_AT=f"3:{run / 'stop-request'}"))
    stdout, stderr = stopped.communicate(timeout=240)
    assert stopped.returncode == REQUEUE_EXIT_CODE and "stopping at step 4" in stdout, stderr[-3000:]
    killed = start_in_background(args, nproc=None, env=with_test_hooks(SFT_TEST_DIE_IN_EXPORT="1"))
    stdout, stderr = killed.communicate(timeout=240)
    assert killed.returncode == 9 and (run / "export.tmp").is_dir() and not (run / "export").exists(), stderr[-3000:]
    run_torchrun(args, nproc=1)
    assert (run / "export" / "config.json").is_file() and not (run / "export.tmp").exists()
    evals = [(e["step"], e["eval_loss"]) for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in e]
    assert [step for step, _ in evals] == [0, 4, 8] and one_entry_per_step(run)
    run_demo(demo_data, tmp_path, "uninterrupted", "train.max_steps=8", "eval.every_steps=4")
    assert eval_losses(run) == eval_losses(tmp_path / "uninterrupted")
