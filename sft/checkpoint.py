"""Checkpoints: sharded `torch.distributed.checkpoint` saves, committed atomically, exact resume.

Layout of a run directory's checkpoints:

    checkpoints/step-N/          one committed checkpoint
        .metadata, *.distcp      DCP: model + optimizer, sharded (reshardable to any world size)
        scheduler.pt             LR scheduler state
        rng-rank{r}.pt           python / numpy / torch / cuda RNG state of rank r
        train_state.json         step, tokens seen, global batch, world size, first eval loss
        digests.json             CRC-32 of every other file, verified before a resume loads it
        config.yaml              the resolved config of the run
        hf/                      the model's config.json and tokenizer (export needs nothing else)
    checkpoints/latest           name of the newest committed checkpoint (for people and tools)

A save writes `step-N.tmp/`, waits for every rank, fsyncs it and renames it to `step-N/`, then
rewrites `latest`, and only then deletes checkpoints beyond `keep_last`: a crash at any point
leaves a complete checkpoint. Resume `auto` takes the newest complete `step-N/`, skipping (with a
warning) any that is incomplete or damaged: every file a resume reads is checked (sizes, parse,
every rank's RNG file), and every file against the CRC-32 of it written at commit (`digests.json`;
the ranks share the reading; a checkpoint whose train_state.json says it has digests and has none
is damaged). A skipped checkpoint is set aside by the run
directory (sft/rundir.py), so a requeued job does not stumble on it again.
A save that fails (disk full, permissions) removes its `.tmp`, leaves the previous checkpoints as
they were and stops the run with one clear error.

Data position: the sampler is a pure function of (seed, step, global batch), so the step is the
data position. Resuming on another number of ranks with the same global batch (micro-batch x
grad-acc x ranks) continues with exactly the samples the original run would have seen.
"""

from __future__ import annotations

import errno
import json
import random
import shutil
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sft import atomic
from sft.config import Config, to_yaml
from sft.errors import UserError
from sft.distributed import DistEnv, decided_on_rank0, log0
from sft.model import initial_weights, load_weights


# A checkpoint holds the fp32 master weights and both Adam moments.
CHECKPOINT_BYTES_PER_PARAMETER = 12


def _read_train_state(path: Path) -> dict:
    state = json.loads(path.read_text())
    for key in ("step", "tokens_seen", "global_batch", "world_size"):
        state[key]  # noqa: B018 -- a KeyError marks the file as damaged
    return state


# Files of a checkpoint besides DCP's, each with a reader that fails if the file is damaged.
_FILES = {
    "train_state.json": _read_train_state,
    "scheduler.pt": lambda path: torch.load(path, weights_only=False),
    "config.yaml": lambda path: yaml.safe_load(path.read_text())["model"],
    "hf/config.json": lambda path: json.loads(path.read_text())["model_type"],
}


class CheckpointError(UserError):
    """A checkpoint cannot be used or written; the message names the directory and the fix."""


def _unusable(resume: str, problem: str, shared: bool = False) -> CheckpointError:
    error = CheckpointError(f"checkpoint.resume={resume!r} is not a usable checkpoint: {problem}")
    error.shared = shared  # raised alike on every rank: reported once
    return error


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


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def committed_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories, newest first."""
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name.removeprefix("step-").isdigit()]
    return sorted(found, key=step_of, reverse=True)


DIGESTS = "digests.json"


def _digest(path: Path) -> str:
    """CRC-32 of a file's bytes: 3.6 GiB/s on one core of the CPU dev machine, and zlib releases the
    GIL, so the writer thread computes it beside training."""
    crc, buffer = 0, bytearray(1 << 24)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"crc32:{crc:08x}"


def _data_files(path: Path, rank: int = 0, world_size: int = 1) -> list[Path]:
    """This rank's share of a checkpoint's DCP data files (every world_size-th, sorted by name)."""
    return sorted(path.glob("*.distcp"))[rank::world_size]


def content_problem(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Which of this rank's share of `path`'s files differs from the digest written at commit (a bit
    flip, a partial overwrite, bytes of the right size that are not the checkpoint), or None. Never
    raises: a file that cannot be read is a problem like any other (every rank must reach the
    collective that compares their answers). A checkpoint written before digests existed has none."""
    reading = DIGESTS
    try:
        if not (path / DIGESTS).is_file():
            reading = "train_state.json"
            state = path / reading
            return f"missing {DIGESTS}" if state.is_file() and json.loads(state.read_text()).get("digests") else None
        digests = json.loads((path / DIGESTS).read_text())
        if not isinstance(digests, dict) or not all(isinstance(d, str) for d in digests.values()):
            return f"unreadable {DIGESTS} (not a mapping of file names to digests)"
        unlisted = [data.name for data in _data_files(path) if data.name not in digests]
        if rank == 0 and unlisted:
            return f"{unlisted[0]} is not in {DIGESTS}"
        for reading in sorted(digests)[rank::world_size]:
            if _digest(path / reading) != digests[reading]:
                return f"{reading} differs from its digest (damaged after it was written)"
        return None
    except Exception as e:  # unreadable (EIO, a stale handle, garbage)
        return f"unreadable {reading} ({type(e).__name__}: {e})"


def _write_shards(state: dict, tmp: Path, group: dist.ProcessGroup | None, rank: int, world_size: int) -> dict:
    """Collective: write the sharded state (DCP) into `tmp`; return the digests of this rank's share
    of the data files, all of which exist once dcp.save returns on any rank."""
    dcp.save(state, checkpoint_id=tmp, process_group=group)
    return {data.name: _digest(data) for data in _data_files(tmp, rank, world_size)}


def checkpoint_problem(path: Path, files: tuple[str, ...] = tuple(_FILES)) -> str | None:
    """Why `path` is not a complete, readable checkpoint (DCP data plus `files`), or None. Never
    raises: a filesystem error is a problem of the checkpoint, and the search goes on."""
    try:
        return _structure_problem(path, files)
    except OSError as e:
        return f"unreadable ({e})"


def _structure_problem(path: Path, files: tuple[str, ...]) -> str | None:
    if not path.is_dir():
        return "no such directory"
    missing = [f for f in (".metadata", *files) if not (path / f).is_file()]
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
    for name in files:
        try:
            _FILES[name](path / name)
        except Exception as e:  # empty, truncated or garbage: what a crash before fsync leaves
            return f"unreadable {name} ({type(e).__name__})"
    if "train_state.json" in files:  # every rank of the saving run wrote its RNG state
        ranks = _read_train_state(path / "train_state.json")["world_size"]
        missing = [f"rng-rank{r}.pt" for r in range(ranks) if not (path / f"rng-rank{r}.pt").is_file()]
        if missing:
            return f"missing {', '.join(missing)}"
    for rng in path.glob("rng-rank*.pt"):
        try:
            torch.load(rng, weights_only=False)
        except Exception as e:
            return f"unreadable {rng.name} ({type(e).__name__})"
    return None


def _shape_mismatches(path: Path, state: dict) -> list[str]:
    """Model tensors that differ between this model and the checkpoint's (another architecture,
    size or depth): shapes of the tensors both have, and tensors only one of them has."""
    saved = {key.removeprefix("model."): tuple(meta.size)
             for key, meta in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
             if key.startswith("model.")}
    ours = {name: tuple(tensor.shape) for name, tensor in state["model"].items()}
    return [f"{name}: {ours.get(name, 'absent')} here, {saved.get(name, 'absent')} in the checkpoint"
            for name in sorted(ours.keys() | saved.keys()) if ours.get(name) != saved.get(name)]


# What a save can raise: DCP reports any rank's failure as a CheckpointException, a BaseException.
SAVE_FAILURES = (Exception, CheckpointException)


def _causes(e: BaseException):
    """A rank's error in a failed save and the errors it was raised from (torch.save buries the
    OSError)."""
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


# A filesystem with less free space than this is full for a checkpoint.
_NEARLY_FULL_BYTES = 1 << 30
# How torch.save reports a write that did not go through (a full disk or quota, an I/O error):
# "... file write failed", or only a short write ("unexpected pos 704 vs 598").
_FAILED_WRITE = ("write failed", "unexpected pos")


def _failed_write(e: BaseException) -> bool:
    return any(isinstance(c, OSError) or any(text in str(c) for text in _FAILED_WRITE) for c in _causes(e))


def _no_space(e: BaseException, directory: Path) -> bool:
    """Whether a failed write into `directory` ran out of disk space or quota."""
    if any((isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left on device" in str(c)
           for c in _causes(e)):
        return True
    # A failed write does not always say why (and DCP hands each rank's error over without what
    # it was raised from): the disk does.
    try:
        return _failed_write(e) and shutil.disk_usage(directory).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class Checkpointer:
    """Owns a run's checkpoints: the resume point, saves committed atomically, and restore,
    including where the initial weights come from when there is nothing to resume."""

    def __init__(self, cfg: Config, tokenizer: PreTrainedTokenizerBase, env: DistEnv):
        self.root = cfg.checkpoints_dir
        self.cfg, self.tokenizer, self.env = cfg, tokenizer, env
        # The save in flight: its commit, the background write, and this rank's own error, if any.
        self._pending: tuple[_WrittenByAllRanks, Future | None, BaseException | None] | None = None
        # Asynchronous saves: a gloo group and a writer thread of their own, so the background
        # collectives do not interleave with the training loop's. Made now, at start-up (a collective):
        # making a group needs the launcher's store, which a stop-save must not (sft/preemption.py).
        # The thread works on this rank's GPU (pinning from another device's context would start a
        # CUDA context there).
        self._group: dist.ProcessGroup | None = None
        self._writer: ThreadPoolExecutor | None = None
        if cfg.checkpoint.stages_in_host_memory:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(minutes=cfg.dist.timeout_minutes))
            on_gpu = env.device.type == "cuda"
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer",
                                              initializer=torch.cuda.set_device if on_gpu else None,
                                              initargs=(env.device,) if on_gpu else ())
        self._staging = HostStaging()
        self._staging_job: Future | None = None  # the writer thread making or pinning host buffers
        self.skipped: set[Path] = set()  # damaged checkpoints resume_point passed over

    def resume_point(self, auto: bool) -> Path | None:
        """Collective: the checkpoint to resume from (`checkpoint.resume`: auto, none or a path),
        complete and readable (rank 0 checks) with its data as written (each rank reads a share of
        the data files against their digests). With auto, a damaged one is skipped for the next
        older, with one line naming the file and what is wrong with it; `skipped` keeps them."""
        resume = self.cfg.checkpoint.resume
        while (candidate := decided_on_rank0(lambda: self._find(resume, auto))) is not None:
            problems: list = [None] * self.env.world_size
            dist.all_gather_object(problems, content_problem(candidate, self.env.rank, self.env.world_size))
            problem = next((p for p in problems if p), None)
            if problem is None:
                break
            if resume not in ("auto", "none"):
                raise _unusable(resume, problem, shared=True)
            log0(f"checkpoint: skipping {candidate} ({problem})")
            self.skipped.add(candidate)
        # Rank 0 also added those it found incomplete: every rank keeps the same set.
        self.skipped = decided_on_rank0(lambda: self.skipped)
        return candidate

    def _find(self, resume: str, auto: bool) -> Path | None:
        if resume not in ("auto", "none"):
            problem = checkpoint_problem(Path(resume))
            if problem:
                raise _unusable(resume, problem)
            return Path(resume)
        if resume == "none" or not auto:
            return None
        for candidate in committed_checkpoints(self.root):
            if candidate in self.skipped:
                continue
            problem = checkpoint_problem(candidate)
            if problem is None:
                return candidate
            log0(f"checkpoint: skipping {candidate} ({problem})")
            self.skipped.add(candidate)  # said once
        return None

    def check_room(self, model: nn.Module, resume_from: Path | None, total_steps: int) -> None:
        """Before the weights load: warn (rank 0, once) when the checkpoints' filesystem has less
        free space than this run's checkpoints will add at their peak (keep_last committed ones
        stay while the next is written), which a save would otherwise learn only when it fails,
        after minutes of writing."""
        c = self.cfg.checkpoint
        if not c.enabled:
            return
        size = CHECKPOINT_BYTES_PER_PARAMETER * sum(p.numel() for p in model.parameters())
        start = step_of(resume_from) if resume_from else 0
        saves = 1 + ((total_steps - 1) // c.every_steps - start // c.every_steps if c.every_steps else 0)
        more = max(1, min(c.most_on_disk, saves) - len(committed_checkpoints(self.root)))
        existing = next(d for d in (self.root, *self.root.parents) if d.exists())
        free = shutil.disk_usage(existing).free
        if free < more * size:
            log0(f"warning: {existing} has {_size(free)} free, and this run's checkpoints need up to "
                 f"{_size(more * size)} more ({more} of {_size(size)}: fp32 weights and Adam "
                 f"moments; checkpoint.keep_last={c.keep_last} stay while the next is written): a save will fail "
                 "when the disk is full, keeping the previous checkpoint; free space, lower checkpoint.keep_last or "
                 "set train.output_dir to a larger filesystem")

    def restore(self, resume_from: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler) -> tuple[dict, str]:
        """Collective: fill the materialised model (and, when resuming, the optimizer and scheduler)
        from the one source that applies; return the train state and what was loaded, for the log."""
        prepared = Path(self.cfg.model.prepared_cache) if self.cfg.model.prepared_cache else None
        prepared_ready = False
        if resume_from is None and prepared is not None:
            prepared_ready = decided_on_rank0(lambda: checkpoint_problem(prepared, ())) is None
        fresh = {"step": 0, "tokens_seen": 0}
        if resume_from is not None:
            state = self._load(resume_from, model, optimizer, scheduler)
            return state, f"resumed from {resume_from} (step {state['step']}, saved by {state['world_size']} ranks)"
        elif prepared_ready:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=prepared)
            set_model_state_dict(model, state["model"])
            return fresh, f"loaded the prepared-model cache {prepared}"
        else:
            load_weights(model, initial_weights(self.cfg.model, self.cfg.train.seed, model), self.env.device)
            source = self.cfg.model.name_or_path if self.cfg.model.init == "pretrained" else "random init"
            if prepared is None:
                return fresh, f"loaded weights from {source}"
            with _WrittenByAllRanks(prepared, self.env) as tmp:
                dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=tmp)
            return fresh, f"loaded weights from {source}; wrote the prepared-model cache {prepared}"

    def _load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        wrong = decided_on_rank0(lambda: _shape_mismatches(path, state))
        if wrong:
            raise CheckpointError(f"{path} was written for another model ({len(wrong)} tensors differ, e.g. "
                                  f"{wrong[0]}); resume with the model it was trained from, or set "
                                  "checkpoint.resume=none")
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        rng = path / f"rng-rank{self.env.rank}.pt"
        if rng.is_file():  # a rank that did not exist in the saving run keeps its fresh seed
            _set_rng_state(torch.load(rng, weights_only=False))
        return _read_train_state(path / "train_state.json")

    def save(self, step: int, model: PreTrainedModel, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, train_state: dict, blocking: bool = True) -> Path:
        """Collective: write checkpoints/step-<step> and commit it; return its path.

        With `blocking=False` and checkpoint.async_save, training waits only while the sharded
        state is copied to host memory; the files are written in the background, and the commit
        (rename, `latest`, retention) happens at the first `poll()` after every rank has finished,
        or at the next save. At most one save is in flight. Besides the sharded state, hf/ holds
        the model's config.json and the tokenizer, so the checkpoint exports without the original
        model directory.
        """
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight: the previous one is committed first
        waited = time.perf_counter() - t0
        if waited > 1:  # the advice is for periodic saves; the final or a stop-save must wait anyway
            log0(f"checkpoint: waited {waited:.1f} s for the previous save's write"
                 + ("; save less often than the disk writes a checkpoint (checkpoint.every_steps)" if not blocking
                    else " to commit first"))
        final = self.root / f"step-{step}"
        commit = _WrittenByAllRanks(final, self.env, checkpoints=self.root)
        tmp = commit.begin()
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        in_background = not blocking and self.cfg.checkpoint.async_save
        background: Future | None = None
        error: BaseException | None = None
        digests: dict = {}
        try:
            # DCP first: its collectives run before any rank can fail alone on the small files.
            if in_background:
                background = self._async_save(state, tmp)
            else:
                digests = _write_shards(state, tmp, None, self.env.rank, self.env.world_size)
            torch.save(_rng_state(), tmp / f"rng-rank{self.env.rank}.pt")
            if self.env.is_main:
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
                (tmp / "config.yaml").write_text(to_yaml(self.cfg))
                (tmp / "train_state.json").write_text(json.dumps({"step": step, **train_state, "digests": True},
                                                                 indent=2))
                model.config.save_pretrained(tmp / "hf")
                self.tokenizer.save_pretrained(tmp / "hf")
        except SAVE_FAILURES as e:  # every rank learns of it in finish(), which raises the one clear error
            error = e
        if in_background:
            # Every rank takes this path, failed or not, so all reach finish() together in wait().
            self._pending = (commit, background, error)
        else:
            self._commit(commit, error, digests)
        return final

    def prepare_staging(self, model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> None:
        """Collective, once after the first step (when Adam's moments exist): with periodic
        asynchronous saves, make and pin the host buffers on the writer thread while training goes
        on, so that the first save, too, only copies."""
        if self.cfg.checkpoint.stages_in_host_memory:
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
            staged = sum(_local(tensor).nbytes for tensor in _tensors_of(state)) / 2**30
            log0(f"checkpoint: asynchronous saves keep {staged:.1f} GiB per rank of host memory for staging "
                 "(rank 0's share; pinned where the state is on the GPU)")
            self._staging_job = self._writer.submit(self._staging.allocate, state, self.env.rank)

    def _async_save(self, state: dict, tmp: Path) -> Future:
        # Training waits only for this copy (and, should they still run, for the buffers being made
        # or pinned); save() waited for the previous write, so the buffers are free.
        t0 = time.perf_counter()
        if self._staging_job is not None:
            self._staging_job.result()
        if (waited := time.perf_counter() - t0) > 1:
            log0(f"checkpoint: waited {waited:.1f} s for the host buffers to be made or pinned (they are made "
                 "after the first step: a first save that comes sooner than that takes waits for them)")
        t0 = time.perf_counter()
        staged_state = self._staging.stage(state)
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()  # the copies into pinned memory are asynchronous
        log0(f"checkpoint: copied the state to host memory in {time.perf_counter() - t0:.1f} s")
        written = self._writer.submit(_write_shards, staged_state, tmp, self._group, self.env.rank,
                                      self.env.world_size)
        # Off the training path and after the write: pin any buffer this save had to make. Not
        # part of `written`: the commit does not wait for it.
        self._staging_job = self._writer.submit(self._staging.pin_new_buffers, self.env.rank)
        return written

    def poll(self) -> None:
        """Collective, once per step while a save is in flight: commit it once every rank's
        background write has finished (never waits for the writes)."""
        if self._pending is not None:
            _, background, _ = self._pending
            done = torch.tensor([float(background is None or background.done())], device=self.env.device)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                self.wait()

    def wait(self) -> None:
        """Collective: finish and commit the save in flight, if any (before the next save, and at
        the end of the run)."""
        if self._pending is None:
            return
        commit, background, error = self._pending
        self._pending = None
        digests: dict = {}
        if background is not None:
            try:
                digests = background.result()
            except SAVE_FAILURES as e:
                error = error or e
        self._commit(commit, error, digests)

    def _commit(self, commit: _WrittenByAllRanks, error: BaseException | None, digests: dict) -> None:
        """Collective: commit the written checkpoint (or raise every rank's one error), then point
        `latest` at it and apply retention (rank 0).

        Only now that the new checkpoint is committed are old ones and leftovers of interrupted
        saves (step-N.tmp, step-N.old) deleted. A failure here is a warning: resume does not need
        `latest`, and what was not deleted is deleted after the next save.
        """
        commit.finish(error, digests)
        final = commit.final

        def publish() -> None:
            try:
                atomic.write_file(self.root / "latest", final.name + "\n")
                for old in [p for p in committed_checkpoints(self.root) if p != final][self.cfg.checkpoint.keep_last - 1:]:
                    shutil.rmtree(old)
                for leftover in [*self.root.glob("step-*.tmp"), *self.root.glob("step-*.old")]:
                    shutil.rmtree(leftover)
                log0(f"checkpoint: committed {final}")
            except OSError as e:
                log0(f"checkpoint: committed {final}, but updating {self.root} failed ({e}); continuing")
        decided_on_rank0(publish)


class HostStaging:
    """Host copies of the sharded training state for asynchronous saves, refilled in place by every
    save. `allocate` makes and pins them ahead of the first save, beside training (only the pinning
    itself holds training up, once); a buffer it did not make (or whose tensor changed shape) is
    made by the save and pinned after its write.
    Pinned, the copies run asynchronously at full PCIe speed.

    Our own rather than DCP's stagers: torch 2.11's DefaultStager drops its buffers after every
    save (its second save then re-pins, and fails with `KeyError: <class 'type'>`), and
    BlockingAsyncStager cannot build its cache without CUDA, where the CPU tests run.
    """

    # Smaller buffers gain nothing from pinning, and may share a page with one already pinned.
    MIN_PINNED_BYTES = 1 << 20

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}  # path in the state dict -> its host copy
        self._to_pin: list[torch.Tensor] = []

    def allocate(self, state: Any, rank: int) -> None:
        """Make the host buffers for `state` (its values are not copied) and pin them. Only a head
        start: should it fail, the first save makes the buffers itself."""
        made: dict[str, torch.Tensor] = {}
        to_pin: list[torch.Tensor] = []

        def empty(path: str, tensor: torch.Tensor) -> torch.Tensor:
            made[path] = torch.empty_like(tensor, device="cpu")  # a DTensor keeps its sharding
            if _local(tensor).is_cuda and _pinnable(_local(made[path])):
                to_pin.append(_local(made[path]))
            return made[path]

        try:
            _map_tensors(state, empty)
            if any(_local(buffer).device.type != "cpu" for buffer in made.values()):
                raise RuntimeError("empty_like(..., device='cpu') did not give host memory")
            for host in to_pin:
                # Fault the new pages in here, beside training: cudaHostRegister would do it while
                # holding up the training loop's CUDA calls (P-7B on 2 x H100, 43 GiB per rank: one
                # step 0.9 -> 19-33 s; faulted in first, the registration costs one step ~3.4 s).
                host.zero_()
        except Exception as e:
            print(f"rank {rank}: checkpoint: staging buffers not made ahead ({type(e).__name__}: {e}); the "
                  "first asynchronous save makes them", flush=True)
            return
        self._to_pin = to_pin
        self.pin_new_buffers(rank)
        self._buffers = made

    def stage(self, state: Any) -> Any:
        """`state` with every tensor replaced by its host copy (DTensors keep their sharding). Copies
        into pinned buffers are asynchronous: synchronize before reading them."""
        previous, self._buffers = self._buffers, {}

        def refill(path: str, tensor: torch.Tensor) -> torch.Tensor:
            buffer = previous.get(path)
            if buffer is not None and _same_layout(buffer, tensor):
                _local(buffer).copy_(_local(tensor), non_blocking=True)
            else:  # not made ahead, or the state changed shape: a new buffer
                buffer = tensor.to("cpu", copy=True)
                if _local(tensor).is_cuda and _pinnable(_local(buffer)):
                    self._to_pin.append(_local(buffer))
            self._buffers[path] = buffer
            return buffer

        return _map_tensors(state, refill)

    def pin_new_buffers(self, rank: int) -> None:
        """Page-lock the buffers made since the last call (not while a copy into them may run). A
        buffer that cannot be pinned (a locked-memory limit) stays pageable: slower copies, same result."""
        failed = sum(int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes,
                                                             1)) != 0  # 1: cudaHostRegisterPortable
                     for host in self._to_pin)
        if failed:
            print(f"rank {rank}: checkpoint: could not pin {failed} of {len(self._to_pin)} staging buffers (the "
                  "locked-memory limit, ulimit -l?); asynchronous saves copy them more slowly", flush=True)
        self._to_pin.clear()


def _map_tensors(state: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], path: str = "") -> Any:
    """`state` (dicts, lists, tuples) with every tensor t replaced by fn(its path, t)."""
    if isinstance(state, dict):
        return {key: _map_tensors(value, fn, f"{path}/{key}") for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_map_tensors(value, fn, f"{path}/{i}") for i, value in enumerate(state))
    return fn(path, state) if isinstance(state, torch.Tensor) else state  # lr, flags: this save's values


def _tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor in `state`, found by the same walk as _map_tensors."""
    found: list[torch.Tensor] = []

    def collect(_: str, tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    _map_tensors(state, collect)
    return found


def _pinnable(host: torch.Tensor) -> bool:
    return host.nbytes >= HostStaging.MIN_PINNED_BYTES


def _same_layout(buffer: torch.Tensor, state: torch.Tensor) -> bool:
    return (type(buffer) is type(state) and buffer.shape == state.shape and buffer.dtype == state.dtype
            and getattr(buffer, "placements", None) == getattr(state, "placements", None))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _WrittenByAllRanks:
    """Collective context: every rank writes its part into `<final>.tmp`; once all have, rank 0
    commits it as `final` (sft.atomic). If any rank's write fails, the .tmp is removed and every
    rank raises the same CheckpointError; what was committed before stays as it was (the error
    names the newest committed checkpoint under `checkpoints`, if given)."""

    def __init__(self, final: Path, env: DistEnv, checkpoints: Path | None = None):
        self.final, self.env, self.checkpoints = final, env, checkpoints
        self.tmp = final.with_name(final.name + ".tmp")

    def begin(self) -> Path:
        """Collective: create `<final>.tmp` for every rank to write into."""
        def make() -> None:
            try:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp.mkdir(parents=True)
            except OSError as e:
                raise CheckpointError(f"cannot create {self.tmp}: {e.strerror}; check the permissions and free "
                                      "space of train.output_dir") from None
        decided_on_rank0(make)
        return self.tmp

    def finish(self, error: BaseException | None, digests: dict | None = None) -> None:
        """Collective: commit (with every rank's `digests` of its data files in digests.json), or
        (if `error`, or another rank's) remove the .tmp and raise the same error on every rank,
        naming the lowest failed rank's cause as that rank judged it."""
        mine = None
        if error is not None:
            try:
                mine = self._judge(error)
            except Exception as e:  # never skip the collective below: the other ranks wait in it
                mine = (False, self.env.rank, f"{type(error).__name__} (judging it failed: {e!r})", False)
        reports: list = [None] * self.env.world_size
        dist.all_gather_object(reports, (mine, digests or {}))
        failed = sorted(cause for cause, _ in reports if cause is not None)
        if not failed:
            everyone = {name: digest for _, share in reports for name, digest in share.items()}
            decided_on_rank0(lambda: self._commit(everyone))
            return
        if self.env.is_main:
            shutil.rmtree(self.tmp, ignore_errors=True)
        _, rank, cause, on_disk = failed[0]
        raise self._error(cause if self.env.world_size == 1 else f"rank {rank}: {cause}", on_disk)

    def __enter__(self) -> Path:
        return self.begin()

    def __exit__(self, kind, error, _tb) -> None:
        self.finish(error)

    def _commit(self, digests: dict) -> None:
        try:
            if digests:  # the ranks' data files, and here every other file (.metadata, RNG states, ...)
                others = [p for p in self.tmp.rglob("*") if p.is_file() and p.suffix != ".distcp"]
                digests = {**digests, **{str(p.relative_to(self.tmp)): _digest(p) for p in others}}
                (self.tmp / DIGESTS).write_text(json.dumps(digests, indent=1, sort_keys=True))
            atomic.commit(self.tmp, self.final)
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise self._error(self._cause(e, _no_space(e, self.tmp.parent)), on_disk=True) from None

    def _judge(self, error: BaseException) -> tuple[bool, int, str, bool]:
        """(whether only other ranks failed, the failed rank, the cause, whether the disk is to
        blame) for this rank's view of a failed save. A rank judges its own failure, against its own
        disk (node-local disks differ); DCP also hands it the other ranks' errors, which those ranks
        judge, so a rank whose own part succeeded ranks behind them."""
        rank, stack, others, first = self.env.rank, None, False, True
        if isinstance(error, CheckpointException) and error.failures:
            others = rank not in error.failures
            rank = min(error.failures) if others else rank
            first = rank == min(error.failures)
            error, stack = error.failures[rank]
        no_space = _no_space(error, self.tmp.parent)
        on_disk = no_space or _failed_write(error)
        if not on_disk and not others and first:
            # Not the disk: a bug, here or in a library. The rank the error names keeps its
            # traceback (DCP hands the error over without it, but with its stack).
            if stack is None:
                traceback.print_exception(error)
            else:
                print(f"Traceback (most recent call last), rank {rank}:\n" + "".join(traceback.format_list(stack))
                      + "".join(traceback.format_exception_only(error)), end="", file=sys.stderr, flush=True)
        return others, rank, self._cause(error, no_space), on_disk

    def _cause(self, error: BaseException, no_space: bool) -> str:
        if no_space:
            return f"no space left on {self.tmp.parent}"
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"

    def _error(self, cause: str, on_disk: bool) -> CheckpointError:
        previous = committed_checkpoints(self.checkpoints) if self.checkpoints else []
        kept = f"; the previous checkpoint {previous[0]} is intact" if previous else ""
        fix = ("free space (or quota) or fix the permissions of train.output_dir" if on_disk else
               "not a disk problem: its traceback is above; set checkpoint.async_save=false if it is in the "
               "asynchronous save, and report it")
        error = CheckpointError(f"saving {self.final} failed ({cause}){kept}; {fix}, then rerun: the run resumes "
                                "from its last checkpoint")
        error.shared = True  # every rank raises it
        return error
