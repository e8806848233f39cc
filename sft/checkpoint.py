"""Checkpoints: sharded `torch.distributed.checkpoint` saves, committed atomically, exact resume.

Layout of a run directory's checkpoints:

    checkpoints/step-N/          one committed checkpoint
        .metadata, *.distcp      DCP: model + optimizer, sharded (reshardable to any world size)
        scheduler.pt             LR scheduler state
        rng-rank{r}.pt           python / numpy / torch / cuda RNG state of rank r
        train_state.json         step, tokens seen, global batch, world size
        config.yaml              the resolved config of the run
        hf/                      the model's config.json and tokenizer (export needs nothing else)
    checkpoints/latest           name of the newest committed checkpoint (a one-line file)

A save writes `step-N.tmp/`, waits for every rank, renames it to `step-N/`, then rewrites
`latest` (write + rename), and only then deletes checkpoints beyond `keep_last`: a crash at any
point leaves `latest` on a complete checkpoint. Resume `auto` takes `latest`, or failing that
the newest complete `step-N/`, skipping (with a warning) any that is incomplete.

Data position: the sampler is a pure function of (seed, step, global batch), so the step is the
data position. Resuming on another number of ranks with the same global batch (micro-batch x
grad-acc x ranks) continues with exactly the samples the original run would have seen.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sft.config import Config, ConfigError, to_yaml
from sft.distributed import DistEnv, log0

# The exit status of a run that stopped on SIGTERM/SIGUSR1 after committing a checkpoint:
# EX_TEMPFAIL, "try again later". slurm/train.slurm turns it into a requeue.
REQUEUE_EXIT_CODE = 75
_FILES = ("train_state.json", "scheduler.pt", "config.yaml", "hf/config.json")


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the directory and what is missing."""


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _written_by_all_ranks(final: Path, env: DistEnv) -> Iterator[Path]:
    """Collective: yield `<final>.tmp` for every rank to write its part into; once all have, rank 0
    renames it to `final`. A crash midway leaves only the .tmp (the distributed counterpart of
    sft.hf_io.atomic_directory)."""
    tmp = final.with_name(final.name + ".tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    yield tmp
    dist.barrier()  # every rank's part is on disk before the directory is committed
    if env.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)


def save_checkpoint(root: Path, step: int, model: PreTrainedModel, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, train_state: dict, config_yaml: str,
                    tokenizer: PreTrainedTokenizerBase, keep_last: int, env: DistEnv) -> Path:
    """Write and commit checkpoints/step-<step>; return its path. Collective: all ranks call it.

    Besides the sharded state, hf/ holds the model's config.json and the tokenizer, so the
    checkpoint exports (sft/export.py) without the original model directory.
    """
    final = root / f"step-{step}"
    with _written_by_all_ranks(final, env) as tmp:
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=tmp)
        torch.save(_rng_state(), tmp / f"rng-rank{env.rank}.pt")
        if env.is_main:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            (tmp / "config.yaml").write_text(config_yaml)
            (tmp / "train_state.json").write_text(json.dumps(train_state, indent=2))
            model.config.save_pretrained(tmp / "hf")
            tokenizer.save_pretrained(tmp / "hf")
    if env.is_main:
        _write_atomically(root / "latest", final.name + "\n")
        # Only now that the new checkpoint is committed: drop old ones and leftovers of saves
        # that were killed midway (step-N.tmp).
        for old in sorted(_committed(root), key=_step_of)[:-keep_last]:
            shutil.rmtree(old)
        for leftover in root.glob("step-*.tmp"):
            shutil.rmtree(leftover)
    dist.barrier()
    return final


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def _committed(root: Path) -> list[Path]:
    return [p for p in root.glob("step-*") if p.is_dir() and p.name.removeprefix("step-").isdigit()]


def checkpoint_problem(path: Path, required: tuple[str, ...] = _FILES) -> str | None:
    """Why `path` is not a complete checkpoint (with the `required` files besides DCP's), or None."""
    if not path.is_dir():
        return "no such directory"
    missing = [f for f in (".metadata", *required) if not (path / f).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unreadable metadata: truncated or corrupt
        return f"unreadable .metadata ({type(e).__name__}: {e})"
    for info in metadata.storage_data.values():
        data = path / info.relative_path
        if not data.is_file() or data.stat().st_size < info.offset + info.length:
            return f"data file {info.relative_path} is missing or truncated"
    return None


def find_checkpoint(root: Path, resume: str) -> Path | None:
    """The checkpoint to resume from: `resume` is auto, none, or a checkpoint directory."""
    if resume == "none":
        return None
    if resume != "auto":
        problem = checkpoint_problem(Path(resume))
        if problem:
            raise CheckpointError(f"checkpoint.resume={resume!r} is not a usable checkpoint: {problem}")
        return Path(resume)
    candidates = sorted(_committed(root), key=_step_of, reverse=True)
    latest = root / "latest"
    if latest.is_file():
        named = root / latest.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for candidate in candidates:
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate
        log0(f"checkpoint: skipping {candidate} ({problem})")
    return None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, env: DistEnv) -> dict:
    """Load model, optimizer, scheduler and this rank's RNG state in place; return the train state."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng = path / f"rng-rank{env.rank}.pt"
    if rng.is_file():  # a rank that did not exist in the saving run keeps its fresh seed
        _set_rng_state(torch.load(rng, weights_only=False))
    return json.loads((path / "train_state.json").read_text())


def prepare_run_dir(cfg: Config, env: DistEnv) -> Path | None:
    """Create the run directory and return the checkpoint to resume from (or None).

    A finished run is kept unless train.overwrite (then its checkpoints are dropped and it starts
    over); an unfinished one (stopped, preempted, crashed) continues from its newest complete
    checkpoint when checkpoint.resume is auto.
    """
    run_dir = cfg.run_dir
    finished = (run_dir / "finished").exists()
    if finished and not cfg.train.overwrite:
        raise ConfigError(f"{run_dir} holds a finished run; set train.overwrite=true or another train.run_name")
    dist.barrier()  # every rank has looked before rank 0 changes anything
    if env.is_main:
        if finished:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            (run_dir / "finished").unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        log0(f"run directory {run_dir}; resolved config:\n{to_yaml(cfg)}")
    return _decided_on_rank0(lambda: find_checkpoint(run_dir / "checkpoints", cfg.checkpoint.resume))


def _decided_on_rank0(decide: Callable[[], object]) -> object:
    """Run `decide` on rank 0 only and hand its result (or its CheckpointError) to every rank:
    one rank reads the shared filesystem instead of all of them, and all ranks agree."""
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", decide())
        except CheckpointError as e:
            outcome[0] = ("error", str(e))
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def load_prepared_model(path: Path, model: nn.Module) -> bool:
    """Fill `model` from a prepared-model cache (a DCP copy of the loaded, cast, sharded initial
    weights) if `path` holds a complete one; return whether it did."""
    if _decided_on_rank0(lambda: checkpoint_problem(path, required=())) is not None:
        return False
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    return True


def save_prepared_model(path: Path, model: nn.Module, env: DistEnv) -> None:
    """Write the prepared-model cache once, committed like a checkpoint."""
    with _written_by_all_ranks(path, env) as tmp:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tmp)
    dist.barrier()
