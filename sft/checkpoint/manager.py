"""The checkpoint manager: the resume point, restore (the one place that decides where the
weights come from), and saves, synchronous or in the background, committed by every rank at once.
What a checkpoint holds, and why the step is the data position: sft/checkpoint/layout.py."""

from __future__ import annotations

import json
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sft import atomic
from sft.adapters.lora import LoRA
from sft.checkpoint.commit import SAVE_FAILURES, AllRanksCommit, write_shards
from sft.checkpoint.layout import (CONFIG, HF_FILES, LATEST, SCHEDULER, TRAIN_STATE, CheckpointError,
                                   checkpoint_problem, committed_checkpoints, content_problem, read_train_state,
                                   rng_file, shape_mismatches, step_of)
from sft.checkpoint.lora_record import lora_change_problem, lora_record
from sft.checkpoint.staging import HostStaging, tensors_of
from sft.config import Config, state_bytes, to_yaml
from sft.distributed import DistEnv, decided_on_rank0, local_part, log0
from sft.hub.layout import is_adapter
from sft.hub.weights import initial_weights, load_weights, write_model_files


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


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without LoRA adapters: what the prepared-model cache holds."""
    return {name: value for name, value in get_model_state_dict(model).items() if not is_adapter(name)}


class Checkpointer:
    """Owns a run's checkpoints: the resume point, saves committed atomically, and restore,
    including where the initial weights come from when there is nothing to resume."""

    def __init__(self, cfg: Config, tokenizer: PreTrainedTokenizerBase, env: DistEnv):
        self.root = cfg.checkpoints_dir
        self.cfg, self.tokenizer, self.env = cfg, tokenizer, env
        # The save in flight: its commit, the background write, and this rank's own error, if any.
        self._pending: tuple[AllRanksCommit, Future | None, BaseException | None] | None = None
        # Asynchronous saves: a gloo group and a writer thread of their own, so the background
        # collectives do not interleave with the training loop's. Made now, at start-up (a collective):
        # making a group needs the launcher's store, which a stop-save must not (sft/training/preemption.py).
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
        self._stepped = False  # whether this run has taken a step (step_done)
        self.skipped: set[Path] = set()  # damaged checkpoints resume_point passed over
        self._lora: LoRA | None = None  # the model's LoRA handle (restore), None without LoRA
        self._prepared: Path | None = None  # the prepared-model cache the weights came from, if they did
        self._lora_record: dict | None = None  # what this LoRA run's adapters are fitted to (rank 0)

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

    def check_room(self, model: nn.Module, lora: LoRA | None, resume_from: Path | None, total_steps: int) -> None:
        """Before the weights load: warn (rank 0, once) when the checkpoints' filesystem has less
        free space than this run's checkpoints will add at their peak (keep_last committed ones
        stay while the next is written), which a save would otherwise learn only when it fails,
        after minutes of writing."""
        c = self.cfg.checkpoint
        if not c.enabled:
            return
        held = lora.checkpointed(model).values() if lora else model.parameters()
        size = state_bytes(self.cfg.optim).checkpoint * sum(p.numel() for p in held)
        start = step_of(resume_from) if resume_from else 0
        saves = 1 + ((total_steps - 1) // c.every_steps - start // c.every_steps if c.every_steps else 0)
        more = max(1, min(c.most_on_disk, saves) - len(committed_checkpoints(self.root)))
        existing = next(d for d in (self.root, *self.root.parents) if d.exists())
        free = shutil.disk_usage(existing).free
        if free < more * size:
            log0(f"warning: {existing} has {_size(free)} free, and this run's checkpoints need up to "
                 f"{_size(more * size)} more ({more} of {_size(size)}: weights and Adam "
                 f"moments; checkpoint.keep_last={c.keep_last} stay while the next is written): a save will fail "
                 "when the disk is full, keeping the previous checkpoint; free space, lower checkpoint.keep_last or "
                 "set train.output_dir to a larger filesystem")

    def restore(self, resume_from: Path | None, model: nn.Module, lora: LoRA | None, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, global_batch: int,
                total_steps: int) -> tuple[dict, str]:
        """Collective: fill the materialised model (and, when resuming, the optimizer and scheduler)
        from the sources that apply; return the train state and what was loaded, for the log.
        Resuming under another global batch (`global_batch`: this run's) is allowed, with a warning.
        A full fine-tuning checkpoint holds the whole model; a LoRA run's (`lora`: the model's LoRA
        handle) holds only what trains, over a base read again from its own source. First, a warning
        if this run's checkpoints (`total_steps`) may not fit the disk."""
        self._lora = lora
        self.check_room(model, lora, resume_from, total_steps)
        t0 = time.perf_counter()
        loaded = None if resume_from is not None and not lora else self._model_weights(model)
        if lora:  # no model file or cache holds the adapters; a resumed checkpoint's replace these
            lora.initialise_adapters(model, self.cfg.train.seed, self.env.device)
        if lora:  # read now, while the base is surely where it was loaded from
            decided_on_rank0(lambda: self.lora_record(model), long_wait=True)
        if resume_from is None:
            return {"step": 0, "tokens_seen": 0}, f"{loaded} in {time.perf_counter() - t0:.1f} s"
        state = self._load(resume_from, model, optimizer, scheduler)
        if state.get("global_batch", global_batch) != global_batch:
            log0(f"warning: global batch {global_batch} != {state['global_batch']} of the checkpoint; the data "
                 "order from here differs from the original run's")
        resumed = f"resumed from {resume_from} (step {state['step']}, saved by {state['world_size']} ranks)"
        return state, f"{resumed if loaded is None else f'{loaded}; {resumed}'} in {time.perf_counter() - t0:.1f} s"

    def _model_weights(self, model: nn.Module) -> str:
        """Collective: the model's own weights, from the prepared-model cache, the Hugging Face files
        or random init (writing the cache where it is asked for and missing); what was loaded."""
        prepared = Path(self.cfg.model.prepared_cache) if self.cfg.model.prepared_cache else None
        if prepared is not None and decided_on_rank0(lambda: checkpoint_problem(prepared, ())) is None:
            # The model's own weights only: LoRA adapters start from their own initialisation.
            state = {"model": _base_state(model)}
            dcp.load(state, checkpoint_id=prepared)  # cast to each parameter's dtype (a LoRA base: bf16)
            set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
            self._prepared = prepared
            return f"loaded the prepared-model cache {prepared}"
        load_weights(model, initial_weights(self.cfg.model, self.cfg.train.seed, model), self.env.device)
        source = self.cfg.model.name_or_path if self.cfg.model.init == "pretrained" else "random init"
        if prepared is None:
            return f"loaded weights from {source}"
        if any(p.dtype != torch.float32 for p in model.parameters()):
            # A LoRA base or bf16 masters: a cache of them would give a later float32 run rounded weights.
            return f"loaded weights from {source}; the prepared-model cache is written by float32 runs only"
        with AllRanksCommit(prepared, self.env) as tmp:
            dcp.save({"model": _base_state(model)}, checkpoint_id=tmp)
        return f"loaded weights from {source}; wrote the prepared-model cache {prepared}"

    def _training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """What a checkpoint holds of the model and optimizer: all of it, or with LoRA what trains
        (the frozen base is read again from its source)."""
        weights = get_model_state_dict(model)  # all of it (buffers, a tied head's second name) without LoRA
        if self._lora:
            held = self._lora.checkpointed(model)
            weights = {name: value for name, value in weights.items() if name in held}
        return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer)}

    def _load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
        state = self._training_state(model, optimizer)

        def check() -> None:  # rank 0, said once
            if self._lora:
                lora_change_problem(path, read_train_state(path / TRAIN_STATE).get("lora"),
                                    self.lora_record(model), self._lora.cfg.allow_resume_change)
            wrong = shape_mismatches(path, state["model"])
            if wrong:
                raise CheckpointError(f"{path} was written for another model ({len(wrong)} tensors differ, e.g. "
                                      f"{wrong[0]}); resume with the model it was trained from, or set "
                                      "checkpoint.resume=none")
        decided_on_rank0(check)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not self._lora))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=False))
        rng = path / rng_file(self.env.rank)
        if rng.is_file():  # a rank that did not exist in the saving run keeps its fresh seed
            _set_rng_state(torch.load(rng, weights_only=False))
        return read_train_state(path / TRAIN_STATE)

    def save(self, step: int, model: PreTrainedModel, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, train_state: dict, blocking: bool = True) -> Path | None:
        """Collective: write checkpoints/step-<step> and commit it; return its path (None with
        checkpoint.enabled=false: nothing is written).

        With `blocking=False` and checkpoint.async_save, training waits only while the sharded
        state is copied to host memory; the files are written in the background, and the commit
        (rename, `latest`, retention) happens at the first `step_done()` after every rank has finished,
        or at the next save. At most one save is in flight. Besides the sharded state, hf/ holds
        the model's config.json and the tokenizer, so the checkpoint exports without the original
        model directory.
        """
        if not self.cfg.checkpoint.enabled:
            return None
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight: the previous one is committed first
        waited = time.perf_counter() - t0
        if waited > 1:  # the advice is for periodic saves; the final or a stop-save must wait anyway
            log0(f"checkpoint: waited {waited:.1f} s for the previous save's write"
                 + ("; save less often than the disk writes a checkpoint (checkpoint.every_steps)" if not blocking
                    else " to commit first"))
        final = self.root / f"step-{step}"
        commit = AllRanksCommit(final, self.env, checkpoints=self.root)
        tmp = commit.begin()
        state = self._training_state(model, optimizer)
        in_background = not blocking and self.cfg.checkpoint.async_save
        background: Future | None = None
        error: BaseException | None = None
        digests: dict = {}
        try:
            # DCP first: its collectives run before any rank can fail alone on the small files.
            if in_background:
                background = self._async_save(state, tmp)
            else:
                digests = write_shards(state, tmp, None, self.env.rank, self.env.world_size)
            torch.save(_rng_state(), tmp / rng_file(self.env.rank))
            if self.env.is_main:
                torch.save(scheduler.state_dict(), tmp / SCHEDULER)
                (tmp / CONFIG).write_text(to_yaml(self.cfg))
                if self._lora:
                    train_state = {**train_state, "lora": self.lora_record(model)}
                (tmp / TRAIN_STATE).write_text(json.dumps({"step": step, **train_state, "digests": True}, indent=2))
                write_model_files(self.cfg.model, model, tmp / HF_FILES)
                self.tokenizer.save_pretrained(tmp / HF_FILES)
        except SAVE_FAILURES as e:  # every rank learns of it in finish(), which raises the one clear error
            error = e
        if in_background:
            # Every rank takes this path, failed or not, so all reach finish() together in wait().
            self._pending = (commit, background, error)
        else:
            self._commit(commit, error, digests)
        log0(f"saved {final} in {time.perf_counter() - t0:.1f} s" + (" (training blocked; writing on)" if in_background
                                                                     else ""))
        return final

    def lora_record(self, model: nn.Module) -> dict:
        """Rank 0: what this LoRA run's adapters are fitted to (sft/checkpoint/lora_record.py)."""
        if self._lora_record is None:
            self._lora_record = lora_record(self.cfg.model, self._lora, self.cfg.train.seed, model, self._prepared)
        return self._lora_record

    def close(self) -> None:
        """At a run's end, after its last save: the writer thread joined and the asynchronous saves'
        group let go (distributed.shut_down destroys it)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self._writer = self._group = self._staging_job = None

    def step_done(self, model: PreTrainedModel, optimizer: torch.optim.Optimizer, stopping: bool = False) -> None:
        """Collective, after every optimizer step: commit a background save once every rank has
        written it; after this run's first step, start making the staging buffers (not when the run
        is `stopping`: the stop-save is synchronous)."""
        self._poll()
        if not self._stepped and not stopping:
            self._stepped = True
            self._prepare_staging(model, optimizer)

    def _prepare_staging(self, model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> None:
        """Collective, once after the first step (when Adam's moments exist): with periodic
        asynchronous saves, make and pin the host buffers on the writer thread while training goes
        on, so that the first save, too, only copies."""
        if self.cfg.checkpoint.stages_in_host_memory:
            state = self._training_state(model, optimizer)
            staged = sum(local_part(tensor).nbytes for tensor in tensors_of(state)) / 2**30
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
        written = self._writer.submit(write_shards, staged_state, tmp, self._group, self.env.rank,
                                      self.env.world_size)
        # Off the training path and after the write: pin any buffer this save had to make. Not
        # part of `written`: the commit does not wait for it.
        self._staging_job = self._writer.submit(self._staging.pin_new_buffers, self.env.rank)
        return written

    def _poll(self) -> None:
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

    def _commit(self, commit: AllRanksCommit, error: BaseException | None, digests: dict) -> None:
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
                atomic.write_file(self.root / LATEST, final.name + "\n")
                older = [p for p in committed_checkpoints(self.root) if p != final]
                for old in older[self.cfg.checkpoint.keep_last - 1:]:
                    shutil.rmtree(old)
                for leftover in [*self.root.glob("step-*.tmp"), *self.root.glob("step-*.old")]:
                    shutil.rmtree(leftover)
                log0(f"checkpoint: committed {final}")
            except OSError as e:
                log0(f"checkpoint: committed {final}, but updating {self.root} failed ({e}); continuing")
        decided_on_rank0(publish)
