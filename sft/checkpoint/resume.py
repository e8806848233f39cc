"""Where a run resumes from: `checkpoint.resume` (auto, none or a path), a checkpoint that is
complete and readable, with its data as written; with auto, damaged ones are passed over for the next
older, each said once. And the run's checkpoints' room on disk, warned about before the first save."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
from torch import nn

from sft.adapters.lora import LoRA
from sft.checkpoint.layout import CheckpointError, checkpoint_problem, committed_checkpoints, content_problem, step_of
from sft.config import Config, state_bytes
from sft.distributed import DistEnv, decided_on_rank0, log0


def _unusable(resume: str, problem: str, shared: bool = False) -> CheckpointError:
    error = CheckpointError(f"checkpoint.resume={resume!r} is not a usable checkpoint: {problem}")
    error.shared = shared  # raised alike on every rank: reported once
    return error


def resume_point(cfg: Config, env: DistEnv, auto: bool, skipped: set[Path]) -> Path | None:
    """Collective: the checkpoint to resume from, complete and readable (rank 0 checks) with its
    data as written (each rank reads a share of the data files against their digests). The damaged
    ones passed over join `skipped`, the same set on every rank."""
    resume = cfg.checkpoint.resume
    while (candidate := decided_on_rank0(lambda: _find(cfg.checkpoints_dir, resume, auto, skipped))) is not None:
        problems: list = [None] * env.world_size
        dist.all_gather_object(problems, content_problem(candidate, env.rank, env.world_size))
        problem = next((p for p in problems if p), None)
        if problem is None:
            break
        if resume not in ("auto", "none"):
            raise _unusable(resume, problem, shared=True)
        log0(f"checkpoint: skipping {candidate} ({problem})")
        skipped.add(candidate)
    # Rank 0 also added those it found incomplete: every rank keeps the same set.
    skipped.update(decided_on_rank0(lambda: skipped))
    return candidate


def _find(root: Path, resume: str, auto: bool, skipped: set[Path]) -> Path | None:
    if resume not in ("auto", "none"):
        problem = checkpoint_problem(Path(resume))
        if problem:
            raise _unusable(resume, problem)
        return Path(resume)
    if resume == "none" or not auto:
        return None
    for candidate in committed_checkpoints(root):
        if candidate in skipped:
            continue
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate
        log0(f"checkpoint: skipping {candidate} ({problem})")
        skipped.add(candidate)  # said once
    return None


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_room(cfg: Config, model: nn.Module, lora: LoRA | None, resume_from: Path | None, total_steps: int) -> None:
    """Before the weights load: warn (rank 0, once) when the checkpoints' filesystem has less
    free space than this run's checkpoints will add at their peak (keep_last committed ones
    stay while the next is written), which a save would otherwise learn only when it fails,
    after minutes of writing."""
    c, root = cfg.checkpoint, cfg.checkpoints_dir
    if not c.enabled:
        return
    held = lora.checkpointed(model).values() if lora else model.parameters()
    size = state_bytes(cfg.optim).checkpoint * sum(p.numel() for p in held)
    start = step_of(resume_from) if resume_from else 0
    saves = 1 + ((total_steps - 1) // c.every_steps - start // c.every_steps if c.every_steps else 0)
    more = max(1, min(c.most_on_disk, saves) - len(committed_checkpoints(root)))
    existing = next(d for d in (root, *root.parents) if d.exists())
    free = shutil.disk_usage(existing).free
    if free < more * size:
        log0(f"warning: {existing} has {_size(free)} free, and this run's checkpoints need up to "
             f"{_size(more * size)} more ({more} of {_size(size)}: weights and Adam "
             f"moments; checkpoint.keep_last={c.keep_last} stay while the next is written): a save will fail "
             "when the disk is full, keeping the previous checkpoint; free space, lower checkpoint.keep_last or "
             "set train.output_dir to a larger filesystem")
