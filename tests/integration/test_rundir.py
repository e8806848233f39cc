"""Nothing lost: overwrite, resume, damaged checkpoints, a second launch, unwritable or full disks.

Each case checks that the last committed state survives and that the user gets one clear line.
Under torchrun a failed run exits 1 whatever the worker's code (train.py itself exits 2) and
torchrun prints its own ChildFailedError summary, so the launches here check the worker's
output: one `error:` line and no traceback from train.py.
"""

import errno
import json
import os
import shutil
import signal

import pytest
import torch

from helpers import (REPO, demo_args, eval_losses, one_entry_per_step, run_demo, run_torchrun, start_in_background,
                     train_losses, wait_for_step, with_test_hooks)
from sft.checkpoint.layout import checkpoint_problem

pytestmark = pytest.mark.slow


def one_clear_error(proc) -> str:
    """The single `error:` line of a failed launch (and no traceback through train.py)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert 'train.py", line' not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def snapshot(run_dir):
    """Every file of a run directory with its bytes (what must survive a failed rerun)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, demo_data):
    """A finished 2-step run with a checkpoint at every step and an export."""
    out = tmp_path_factory.mktemp("rundir")
    run_demo(demo_data, out, "done", "train.max_steps=2", "checkpoint.every_steps=1", "eval.every_steps=0",
             "train.overwrite=false", "logging.tensorboard=true")
    return out


def copy_run(finished, name):
    shutil.copytree(finished / "done", finished / name)
    return finished / name


def test_overwrite_that_fails_to_start_keeps_the_previous_run(finished, demo_data, tmp_path):
    run = copy_run(finished, "failing")
    before = snapshot(run)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')  # no assistant turn: nothing to train
    proc = run_demo(demo_data, finished, "failing", "train.overwrite=true", f"data.path={bad}", check=False)
    assert "every train sample was dropped" in one_clear_error(proc)
    assert snapshot(run) == before


def test_overwrite_keeps_the_old_run_until_the_new_one_finishes(finished, demo_data):
    run = copy_run(finished, "overwritten")
    old_loss = train_losses(run)
    run_demo(demo_data, finished, "overwritten", "train.overwrite=true", "train.max_steps=3", "train.seed=5",
             "eval.every_steps=0")
    assert not (run / "overwritten").exists() and (run / "finished").exists()
    assert sorted(train_losses(run)) == [1, 2, 3] and train_losses(run)[1] != old_loss[1]
    assert (run / "checkpoints" / "latest").read_text() == "step-3\n"


def test_resuming_a_finished_runs_own_checkpoint_continues_it(finished, demo_data):
    run = copy_run(finished, "continued")
    proc = run_demo(demo_data, finished, "continued", "train.overwrite=true", "train.max_steps=4",
                    f"checkpoint.resume={run / 'checkpoints' / 'step-2'}", "eval.every_steps=0")
    assert f"resumed from {run / 'checkpoints' / 'step-2'} (step 2" in proc.stdout
    assert sorted(train_losses(run)) == [1, 2, 3, 4]  # the same run, two more steps
    assert (run / "finished").exists() and (run / "checkpoints" / "latest").read_text() == "step-4\n"
    # The closing line compares with the run's first eval, which a resume does not recompute.
    assert f"eval loss {eval_losses(run)[0]:.4f} ->" in proc.stdout
    assert "step 2: eval loss" not in proc.stdout  # no extra full eval at the resume step


def test_a_finished_run_is_not_rerun_by_accident(finished, demo_data):
    proc = run_demo(demo_data, finished, "done", "train.max_steps=2", "train.overwrite=false", check=False)
    assert "holds a finished run; set train.overwrite=true" in one_clear_error(proc)


@pytest.mark.parametrize("damage", ["train_state.json", "scheduler.pt", "rng-rank0.pt", "config.yaml"])
def test_damaged_files_of_a_committed_checkpoint_are_detected(finished, damage):
    step = finished / "damaged" / damage
    shutil.copytree(finished / "done" / "checkpoints" / "step-2", step)
    assert checkpoint_problem(step) is None
    (step / damage).write_bytes(b"")  # what a crash before fsync can leave
    assert checkpoint_problem(step).startswith(f"unreadable {damage} (")
    (step / damage).write_bytes(b"\x00garbage")
    assert checkpoint_problem(step).startswith(f"unreadable {damage}")


def test_resume_skips_a_damaged_checkpoint_and_ignores_a_garbage_latest(finished, demo_data):
    run = copy_run(finished, "skip")
    (run / "finished").unlink()  # as if it had been interrupted after step 2
    (run / "checkpoints" / "step-2" / "train_state.json").write_text("")
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe garbage")
    proc = run_demo(demo_data, finished, "skip", "train.max_steps=3", "eval.every_steps=0", "logging.tensorboard=true")
    assert "skipping" in proc.stdout and "unreadable train_state.json" in proc.stdout
    assert f"resumed from {run / 'checkpoints' / 'step-1'} (step 1" in proc.stdout
    assert (run / "checkpoints" / "latest").read_text() == "step-3\n"
    # Step 2, trained again, has one entry, the new one's; so has TensorBoard (its events past step 1 purged).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert one_entry_per_step(run) and sorted(train_losses(run)) == [1, 2, 3]
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (step, pytest.approx(loss)) for step, (loss, _) in sorted(train_losses(run).items())]


def test_resume_takes_the_newest_complete_checkpoint_whatever_latest_says(finished, demo_data):
    run = copy_run(finished, "newest")
    (run / "finished").unlink()
    (run / "checkpoints" / "latest").write_text("step-1\n")  # stale: step-2 was committed after it
    proc = run_demo(demo_data, finished, "newest", "train.max_steps=3", "eval.every_steps=0")
    assert f"resumed from {run / 'checkpoints' / 'step-2'} (step 2" in proc.stdout


def test_resuming_into_another_architecture_is_one_clear_error(finished, demo_data, tmp_path):
    from helpers import model_dir

    other = model_dir(tmp_path, tied=True, num_hidden_layers=3)
    proc = run_demo(demo_data, tmp_path, "other", f"model.name_or_path={other}",
                    f"checkpoint.resume={finished / 'done' / 'checkpoints' / 'step-2'}", nproc=2, check=False)
    error = one_clear_error(proc)  # once, from rank 0
    assert "was written for another model" in error and "checkpoint.resume=none" in error


def test_exports_and_checkpoints_are_readable_by_the_group(finished):
    run = finished / "done"
    mask = os.umask(0)
    os.umask(mask)  # read it back: the runs wrote under this umask (022 as usual: 0644 files)
    for path in [*(run / "export").iterdir(), *(run / "checkpoints" / "step-2").iterdir()]:
        if path.is_file():
            assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path


def test_a_second_launch_of_a_running_run_refuses(tmp_path, demo_data):
    first = start_in_background(demo_args(demo_data, tmp_path, "busy", "train.max_steps=1000", "eval.every_steps=0"),
                                nproc=1)
    try:
        wait_for_step(first, tmp_path / "busy", 1)
        second = run_demo(demo_data, tmp_path, "busy", "train.max_steps=1000", check=False)
        error = one_clear_error(second)
        assert "is in use by another launch (host " in error
        assert "Slurm job" in error and "another train.run_name" in error
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert (tmp_path / "busy" / "checkpoints" / "latest").is_file()  # the first run was not disturbed


@pytest.mark.parametrize("output_dir, message", [
    ("a_file/runs", "cannot write there (Not a directory); choose a writable train.output_dir"),
])
def test_unwritable_output_dir_is_one_clear_line(tmp_path, demo_data, output_dir, message):
    (tmp_path / "a_file").write_text("not a directory")
    proc = run_demo(demo_data, tmp_path, "x", f"train.output_dir={tmp_path / output_dir}", check=False)
    assert message in one_clear_error(proc)


def test_config_errors_under_torchrun_are_reported_once(tmp_path, demo_data):
    proc = run_torchrun(demo_args(demo_data, tmp_path, "x", "ac.ratio=2"), nproc=2, check=False)
    assert one_clear_error(proc).startswith("error: invalid config (configs/demo.yaml with overrides")
    assert "ac.ratio=2.0: must be in [0, 1]" in proc.stderr
    assert not (tmp_path / "x").exists()


def bad_inputs(tmp_path, demo_data) -> dict[str, tuple[list[str], str]]:
    """case -> (train.py overrides, what its one error line says)."""
    from helpers import FALCON_H1, model_dir, tiny_model_dir, vision_language_model_dir
    from sft.config import ModelConfig
    from sft.hub.layout import write_safetensors
    from sft.hub.weights import RandomWeights

    good = (demo_data / "train.jsonl").read_text().splitlines(keepends=True)
    files = {
        "malformed.jsonl": "".join(good[:20]) + '{"messages": [oops\n' + "".join(good[20:23]),
        "empty.jsonl": "",
        "no_assistant.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n' * 3,
        "robot.jsonl": '{"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "ok"}]}\n',
        "lists.jsonl": '[{"role": "user", "content": "hi"}]\n',
        "int_content.jsonl": '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "ok"}]}\n',
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.jsonl").write_bytes("".join(good[:3]).encode() + '{"messages": [{"role": "user", "content": '
                                            '"caf\xe9"}, {"role": "assistant", "content": "ok"}]}\n'.encode("latin1"))
    (tmp_path / "latin1.json").write_bytes(b'[{"messages": [{"role": "user", "content": "caf\xe9"}, '
                                           b'{"role": "assistant", "content": "ok"}]}]\n')
    # The demo model's weights (4 blocks) under a config.json of 5 blocks.
    other = model_dir(tmp_path, tied=True, num_hidden_layers=5)
    weights = RandomWeights(ModelConfig(name_or_path=str(REPO / "configs" / "demo" / "model"), init="random"), 0)
    write_safetensors(((n, weights.read(n, (), torch.device("cpu"))) for n, _ in weights.reference.named_parameters()),
                      other)
    # The demo model's own weights, then damaged as a failed download or a full disk leaves them.
    damaged = {}
    for damage in ("truncated", "garbage", "empty"):
        damaged[damage] = shutil.copytree(model_dir(tmp_path, tied=True), tmp_path / f"model_{damage}")
        write_safetensors(((n, weights.read(n, (), torch.device("cpu"))) for n, _ in
                           weights.reference.named_parameters()), damaged[damage])
        shard = damaged[damage] / "model-00001-of-00001.safetensors"
        shard.write_bytes({"truncated": shard.read_bytes()[:-100], "garbage": os.urandom(300), "empty": b""}[damage])
    # A real tokenizer's 151k ids (here: the demo's with 1,000 tokens added) into the demo model's 899 rows.
    from transformers import AutoTokenizer
    larger = AutoTokenizer.from_pretrained(REPO / "configs" / "demo" / "model")
    larger.add_tokens([f"extra{i}" for i in range(1000)])
    larger.save_pretrained(tmp_path / "larger_tokenizer")
    data = lambda name: f"data.path={tmp_path / name}"  # noqa: E731
    return {
        "missing model directory": (["model.name_or_path=/no/such/model"],
                                    "model.name_or_path='/no/such/model': no such directory"),
        # plan.auto reads the model's shapes before anything else (plan.gpu_mem_gib: as on a GPU)
        "missing model directory, plan.auto": (["model.name_or_path=/no/such/model", "plan.auto=true",
                                                "plan.gpu_mem_gib=80"],
                                               "model.name_or_path='/no/such/model': no such directory"),
        "a tokenizer larger than the model's vocabulary": ([f"model.tokenizer={tmp_path / 'larger_tokenizer'}"],
                                                           "has 1899 tokens, but model.name_or_path="),
        "malformed JSONL": ([data("malformed.jsonl")], "line 21 is not valid JSON"),
        "empty file": ([data("empty.jsonl")], "empty.jsonl': the dataset is empty"),
        "weights of another architecture": ([f"model.name_or_path={other}", "model.init=pretrained"],
                                            "its weights do not match its config.json (12 tensors differ, e.g. "
                                            "model.layers.4."),
        "no assistant turn": ([data("no_assistant.jsonl")], "every train sample was dropped (3x no assistant turn)"),
        "unknown ShareGPT role": ([data("robot.jsonl")], "unknown ShareGPT role 'robot'"),
        "rows that are lists": ([data("lists.jsonl")], "(found: role, content); each line looks like a bare list of "
                                                       "messages: write {\"messages\": [...]}"),
        "integer content": ([data("int_content.jsonl")], "user content is int, expected a string"),
        "not UTF-8": ([data("latin1.jsonl")], "line 4 is not UTF-8 text (byte 0xe9 at column 47)"),
        "a JSON file not in UTF-8": ([data("latin1.json")], "line 1 is not UTF-8 text (byte 0xe9 at column 48)"),
        "an override that is not YAML": (["data.chat_template_kwargs={a: 1"], "the value is not valid YAML"),
        "packing a Mamba hybrid": ([f"model.name_or_path={tiny_model_dir(tmp_path, 'falcon_h1', **FALCON_H1)}",
                                    "data.packing=true"],
                                   "data.packing=true: FalconH1ForCausalLM's hybrid layers (FalconH1Mixer)"),
        "random init of a vision-language checkpoint": ([f"model.name_or_path={vision_language_model_dir(tmp_path, 'qwen3_5')}"],
                                                        "model.init='random': model.name_or_path="),
        "nf4 without LoRA": (["lora.base=nf4"], "lora.base='nf4': the frozen base of LoRA, and lora.rank=0 trains"),
        "no expert parallelism of 0": (["moe.ep_degree=0"], "moe.ep_degree=0: must be >= 1"),
        "lean state without plan.auto": (["plan.allow_lean_state=true"], "plan.allow_lean_state=True: lets plan.auto"),
        "attention with a typo": (["model.attn_implementation=sdap"], "model.attn_implementation='sdap': not an "
                                                                      "attention implementation transformers knows"),
        "flash attention without its package": (["model.attn_implementation=flash_attention_2"],
                                                "needs the flash_attn package, which is not installed here"),
        **{f"{damage} safetensors": ([f"model.name_or_path={path}", "model.init=pretrained"],
                                     "model-00001-of-00001.safetensors is damaged (")
           for damage, path in damaged.items()},
    }


def test_bad_input_under_torchrun_is_one_line_from_rank_0(tmp_path, demo_data):
    """Every rank reads the same bad input; the user reads about it once, and only our line (not
    also the datasets library's, counted differently)."""
    cases = bad_inputs(tmp_path, demo_data)
    # A run name each: the lock of a failed start is held until its process exits.
    argvs = {name.replace(" ", "_"): demo_args(demo_data, tmp_path, name.replace(" ", "_"), "data.eval_path=null",
                                               "dist.timeout_minutes=0.5", *overrides)[1:]
             for name, (overrides, _) in cases.items()}
    (tmp_path / "cases.json").write_text(json.dumps(argvs))
    (tmp_path / "out").mkdir()
    run_torchrun(["tests/errors_worker.py", str(tmp_path / "cases.json"), str(tmp_path / "out")], nproc=2)
    for name, (_, message) in cases.items():
        said = {rank: (tmp_path / "out" / f"{name.replace(' ', '_')}.rank{rank}.txt").read_text() for rank in (0, 1)}
        errors = [line for text in said.values() for line in text.splitlines() if line.startswith("error")]
        # The error, and for a config its list of problems ("  - key=value: ...") below it.
        error = said[0][said[0].find(errors[0]):] if errors else ""
        assert len(errors) == 1 and errors[0].startswith("error: ") and message in error, (name, said)
        assert "Traceback" not in said[0] + said[1] and " row " not in said[0] + said[1], (name, said)
    # A failed start leaves no trace: no run directory, no lock file.
    assert not any((tmp_path / name).exists() or (tmp_path / f".{name}.lock").exists() for name in argvs)


@pytest.fixture
def checkpointer(tmp_path):
    """In-process, a world of one: the demo model (uninitialised), its optimizer and scheduler, and
    a Checkpointer with periodic asynchronous saves, as train.py makes them."""
    import torch.distributed as dist

    from sft.checkpoint.manager import Checkpointer
    from sft.config import load_config
    from sft.distributed import init_distributed
    from sft.models.build import build_meta_model
    from sft.hub.tokenizer import load_tokenizer

    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"data.path={data}", "data.eval_path=null",
                                                        f"train.output_dir={tmp_path}", "checkpoint.every_steps=1"])
    env = init_distributed()
    try:
        model = build_meta_model(cfg.model).to_empty(device="cpu")
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        yield Checkpointer(cfg, load_tokenizer(cfg.model), env), (model, optimizer, scheduler)
    finally:
        dist.destroy_process_group()


TRAIN_STATE = {"tokens_seen": 0, "global_batch": 1, "world_size": 1}


def test_a_full_disk_during_a_save_is_one_error_and_keeps_the_previous_checkpoint(checkpointer, monkeypatch):
    """The DCP write raises ENOSPC as a full disk would."""
    import torch.distributed.checkpoint as dcp

    from sft.checkpoint.layout import CheckpointError

    ckpt, training = checkpointer
    first = ckpt.save(1, *training, TRAIN_STATE)
    before = snapshot(first)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, *training, TRAIN_STATE)
    assert str(err.value).startswith(f"saving {ckpt.root / 'step-2'} failed (no space left on {ckpt.root}); "
                                     f"the previous checkpoint {first} is intact")
    assert snapshot(first) == before and not (ckpt.root / "step-2.tmp").exists()
    assert not (ckpt.root / "step-2").exists() and (ckpt.root / "latest").read_text() == "step-1\n"


@pytest.mark.parametrize("blocking, advice", [
    (False, "; save less often than the disk writes a checkpoint (checkpoint.every_steps)"),
    (True, " to commit first"),  # a stop-save or the final save: no advice about the frequency
])
def test_a_save_that_waits_for_the_previous_write_says_why(checkpointer, monkeypatch, capsys, blocking, advice):
    import time

    import torch.distributed.checkpoint as dcp

    ckpt, training = checkpointer
    save = dcp.save
    monkeypatch.setattr(dcp, "save", lambda *args, **kwargs: (time.sleep(1.5), save(*args, **kwargs))[1])
    ckpt.save(1, *training, TRAIN_STATE, blocking=False)  # written in the background
    ckpt.save(2, *training, TRAIN_STATE, blocking=blocking)
    ckpt.wait()
    waited = [line for line in capsys.readouterr().out.splitlines() if "for the previous save's write" in line]
    assert len(waited) == 1 and waited[0].endswith(advice), waited


# (checkpoints already committed, checkpoint.every_steps, keep_last, total steps, resumed from step)
#   -> checkpoints the run adds at its peak
ROOM_CASES = {
    "first run, a save every step: keep_last committed + the one being written": ((), 1, 2, 10, None, 3),
    "only the final save": ((), 0, 2, 10, None, 1),
    "fewer saves (4, 8, final 10) than keep_last + 1": ((), 4, 3, 10, None, 3),
    "resumed at step 4 with keep_last on disk: only one more at a time": ((2, 4), 2, 2, 10, 4, 1),
}


@pytest.mark.parametrize("case", list(ROOM_CASES))
def test_a_run_whose_checkpoints_will_not_fit_is_warned_before_the_weights_load(tmp_path, monkeypatch, capsys, case):
    """The 14B save that filled a 234 GiB disk after minutes of writing: said before training."""
    from sft.checkpoint.resume import check_room
    from sft.config import STATE_BYTES, load_config
    from sft.models.build import build_meta_model

    committed, every, keep, total, resumed, more = ROOM_CASES[case]
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"data.path={data}", "data.eval_path=null",
                                                        f"train.output_dir={tmp_path}", f"checkpoint.every_steps={every}",
                                                        f"checkpoint.keep_last={keep}"])
    for step in committed:
        (cfg.checkpoints_dir / f"step-{step}").mkdir(parents=True)
    model = build_meta_model(cfg.model)
    size = STATE_BYTES.checkpoint * sum(p.numel() for p in model.parameters())
    resume_from = cfg.checkpoints_dir / f"step-{resumed}" if resumed else None
    real = shutil.disk_usage(tmp_path)
    for free, warned in ((more * size, False), (more * size - 1, True)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: real._replace(free=free))
        check_room(cfg, model, None, resume_from, total)
        out = capsys.readouterr().out
        assert (f"and this run's checkpoints need up to {more * size / 2**20:.1f} MiB more ({more} of " in out) == warned
        assert ("free space, lower checkpoint.keep_last or set train.output_dir" in out) == warned


def test_resuming_an_older_checkpoint_sets_the_later_ones_aside(finished, demo_data):
    """Retention and `resume: auto` must not take the abandoned later checkpoints for this run's."""
    run = copy_run(finished, "older")
    (run / "finished").unlink()
    proc = run_demo(demo_data, finished, "older", "train.max_steps=3", "eval.every_steps=0", "checkpoint.every_steps=1",
                    "checkpoint.keep_last=1", f"checkpoint.resume={run / 'checkpoints' / 'step-1'}")
    assert "checkpoints after step 1 moved to" in proc.stdout
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-3"]
    assert (run / "checkpoints" / "latest").read_text() == "step-3\n" and not (run / "overwritten").exists()


# How one rank's part of a save fails -> what the one error says.
DISK = "free space (or quota) or fix the permissions"
SAVE_FAILURES = {
    "full disk": ({"SFT_TEST_FULL_DISK_RANK": "1"}, "(rank 1: no space left on", DISK),
    "a bug": ({"SFT_TEST_SAVE_BUG_RANK": "1"}, "(rank 1: KeyError: <class 'type'>)", "not a disk problem: its traceback"),
    "full disk in the shards": ({"SFT_TEST_SHARDS_FAIL": "1:no-space"}, "(rank 1: no space left on", DISK),
    # A 14B save on a full disk (4 x H100) failed with only this short write: the disk's free space says why.
    "full disk, short write in the shards": ({"SFT_TEST_SHARDS_FAIL": "1:short-write-full-disk"},
                                             "(rank 1: no space left on", DISK),
    # The same on a disk with space (a quota, an I/O error) is still the disk's; here on rank 0, the coordinator.
    "short write in rank 0's shards": ({"SFT_TEST_SHARDS_FAIL": "0:short-write"},
                                       "(rank 0: RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos",
                                       DISK),
    "a bug in the shards": ({"SFT_TEST_SHARDS_FAIL": "1:bug"}, "(rank 1: KeyError: <class 'type'>)",
                            "not a disk problem: its traceback"),
}


@pytest.mark.parametrize("how", list(SAVE_FAILURES))
def test_one_ranks_failed_background_save_stops_every_rank_with_one_error(tmp_path, demo_data, how):
    """One rank's part of an asynchronous save fails: both ranks stop at the commit with the same
    one-line error instead of waiting for each other in different collectives; a failure that is
    not the disk's keeps its traceback and does not blame the disk."""
    hooks, cause, fix = SAVE_FAILURES[how]
    proc = run_demo(demo_data, tmp_path, "full", "train.max_steps=4", "checkpoint.every_steps=2", "eval.every_steps=0",
                    nproc=2, env=with_test_hooks(**hooks), check=False, timeout=300)
    error = one_clear_error(proc)
    assert error.startswith(f"error: saving {tmp_path / 'full' / 'checkpoints' / 'step-2'} failed {cause}")
    assert fix in error
    # A bug, and only a bug, gets the failing rank's traceback, once.
    failing_function = {"a bug": "in _failing_save", "a bug in the shards": "in _failing_write"}.get(how)
    assert proc.stderr.count("in _failing_") == (1 if failing_function else 0)
    assert failing_function is None or failing_function in proc.stderr
    assert not (tmp_path / "full" / "checkpoints" / "step-2").exists()
    assert not (tmp_path / "full" / "checkpoints" / "step-2.tmp").exists()
