"""What a run directory keeps across launches: an overwrite keeps the previous finished run until the
new one finishes, whatever happens in between (relaunches, damaged checkpoints skipped,
`checkpoint.resume=none`, an older step resumed), and nothing set aside is ever set aside over.

In-process, a world of one: RunDirectory does what train.py asks of it at each launch (open, then
start at the step the resume point gives), and the test plays the training between launches by
committing checkpoint folders that say which line of training wrote them.
"""

import pytest
import torch.distributed as dist

from helpers import REPO
from sft.config import load_config
from sft.distributed import init_distributed
from sft.training.rundir import RunDirectory


@pytest.fixture(scope="module")
def env():
    yield init_distributed()  # a world of one in this process
    dist.destroy_process_group()


def tree(root) -> dict[str, str]:
    """Every file under `root` with its text: what the line of training that wrote it was."""
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def finished_run(run) -> None:
    """A finished run ("old") with its export, metrics and two checkpoints."""
    for name in ("config.yaml", "metrics.jsonl", "export/model.safetensors", "finished",
                 "checkpoints/step-20/shard", "checkpoints/step-40/shard", "checkpoints/latest"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("old")


def launch(tmp_path, env, *overrides, start_step=0, damaged=(), trains=(), finishes=False) -> RunDirectory:
    """One launch of train.py as RunDirectory sees it: open (lock, checks), start at `start_step`
    (`damaged`: the checkpoints the resume skipped), commit the checkpoints `trains` (step ->
    what wrote it) and, with `finishes`, finish; the lock is released as the process exit would."""
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"data.path={data}", "data.eval_path=null",
                                                        f"train.output_dir={tmp_path}", "train.run_name=run",
                                                        "train.overwrite=false", "checkpoint.export_hf=false",
                                                        *overrides])
    run = RunDirectory(cfg, env)
    try:
        run.open()
        run.start(start_step, {cfg.checkpoints_dir / f"step-{step}" for step in damaged})
        for step, line in trains:
            (cfg.checkpoints_dir / f"step-{step}").mkdir(parents=True)
            (cfg.checkpoints_dir / f"step-{step}" / "shard").write_text(line)
        if finishes:
            run.finish(None)
    finally:
        run.release()  # as the process's exit would
    return run


OLD_RUN = {"checkpoints/latest": "old", "checkpoints/step-20/shard": "old", "checkpoints/step-40/shard": "old",
           "config.yaml": "old", "export/model.safetensors": "old", "finished": "old", "metrics.jsonl": "old"}


def test_an_overwrite_killed_after_its_checkpoints_keeps_the_old_run(tmp_path, env):
    finished_run(tmp_path / "run")
    launch(tmp_path, env, "train.overwrite=true", trains=[(20, "new"), (40, "new")])  # then killed
    assert tree(tmp_path / "run" / "overwritten") == OLD_RUN


# After the interrupted overwrite above, the next launch: (overrides, its start step, damaged
# checkpoints the resume skipped) -> where the new line's step-20 and step-40 are.
RELAUNCHES = {
    "the same command, newest checkpoint damaged: resumes step 20": (
        ["train.overwrite=true"], 20, [40], {"checkpoints/step-20/shard": "new", "damaged/checkpoints/step-40/shard": "new"}),
    "checkpoint.resume=none": (
        ["checkpoint.resume=none"], 0, [],
        {"set-aside/checkpoints/step-20/shard": "new", "set-aside/checkpoints/step-40/shard": "new"}),
    "resuming the older step 20": (
        ["checkpoint.resume={run}/checkpoints/step-20"], 20, [],
        {"checkpoints/step-20/shard": "new", "set-aside/checkpoints/step-40/shard": "new"}),
}


@pytest.mark.parametrize("case", list(RELAUNCHES))
def test_relaunching_an_interrupted_overwrite_never_touches_the_old_run(tmp_path, env, case):
    overrides, start, damaged, new_line = RELAUNCHES[case]
    run = tmp_path / "run"
    finished_run(run)
    launch(tmp_path, env, "train.overwrite=true", trains=[(20, "new"), (40, "new")])
    launch(tmp_path, env, *(o.format(run=run) for o in overrides), start_step=start, damaged=damaged)
    assert tree(run) == {**{f"overwritten/{k}": v for k, v in OLD_RUN.items()}, "config.yaml": tree(run)["config.yaml"],
                         **new_line}


def test_what_is_set_aside_twice_is_kept_under_another_name(tmp_path, env):
    run = tmp_path / "run"
    launch(tmp_path, env, trains=[(20, "first")])
    launch(tmp_path, env, "checkpoint.resume=none", trains=[(20, "second")])
    launch(tmp_path, env, "checkpoint.resume=none")
    assert {k: v for k, v in tree(run).items() if k.startswith("set-aside")} == {
        "set-aside/checkpoints/step-20/shard": "first", "set-aside/checkpoints/step-20.2/shard": "second"}


def test_the_old_run_and_what_was_set_aside_go_only_when_the_overwrite_finishes(tmp_path, env):
    run = tmp_path / "run"
    finished_run(run)
    launch(tmp_path, env, "train.overwrite=true", trains=[(20, "new"), (40, "new"), (60, "new")])
    launch(tmp_path, env, "train.overwrite=true", start_step=40, damaged=[60])
    launch(tmp_path, env, f"checkpoint.resume={run}/checkpoints/step-20", start_step=20, trains=[(60, "newer")])
    assert tree(run / "overwritten") == OLD_RUN
    launch(tmp_path, env, "train.overwrite=true", start_step=60, finishes=True)
    files = tree(run)
    assert sorted(files) == ["checkpoints/step-20/shard", "checkpoints/step-60/shard", "config.yaml",
                             "damaged/checkpoints/step-60/shard", "finished"]
    assert files["damaged/checkpoints/step-60/shard"] == "new"  # damaged ones wait for the user
