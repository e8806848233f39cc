"""The checkpoint manager: the resume point, restore (where the weights come from), and saves,
synchronous or in the background, committed by every rank at once. What a checkpoint holds, and
why the step is the data position: sft/checkpoint/layout.py."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from transformers import PreTrainedTokenizerBase

from sft import atomic, rng
from sft.adapters.lora import LoRA
from sft.checkpoint.background import BackgroundSaves
from sft.checkpoint.commit import SAVE_FAILURES, AllRanksCommit, write_shards
from sft.checkpoint.layout import (CONFIG, HF_FILES, LATEST, SCHEDULER, TRAIN_STATE, CheckpointError,
                                   committed_checkpoints, read_train_state, rng_file, shape_mismatches)
from sft.checkpoint.model_weights import load_model_weights
from sft.checkpoint.reader import read_checkpoint
from sft.checkpoint.resume import check_room, resume_point
from sft.config import Config, to_yaml
from sft.distributed import DistEnv, decided_on_rank0, log0
from sft.hub.weights import write_model_files

Optimizer, Scheduler = torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler


class Checkpointer:
    """Owns a run's checkpoints: the resume point, saves committed atomically, and restore,
    including where the initial weights come from when there is nothing to resume."""

    def __init__(self, cfg: Config, tokenizer: PreTrainedTokenizerBase, env: DistEnv):
        self.root = cfg.checkpoints_dir
        self.cfg, self.tokenizer, self.env = cfg, tokenizer, env
        self._background = BackgroundSaves(cfg, env)  # a collective: at start-up
        self._stepped = False  # whether this run has taken a step (step_done)
        self.skipped: set[Path] = set()  # damaged checkpoints resume_point passed over
        self._lora: LoRA | None = None  # the model's LoRA handle (restore), None without LoRA
        self._prepared: Path | None = None  # the prepared-model cache the weights came from, if they did
        self._lora_record: dict | None = None  # what this LoRA run's adapters are fitted to (rank 0)

    def resume_point(self, auto: bool) -> Path | None:
        """Collective: the checkpoint to resume from (sft/checkpoint/resume.py); `skipped` keeps the
        damaged ones passed over."""
        return resume_point(self.cfg, self.env, auto, self.skipped)

    def restore(self, resume_from: Path | None, model: nn.Module, lora: LoRA | None, optimizer: Optimizer,
                scheduler: Scheduler, global_batch: int, total_steps: int) -> tuple[dict, str]:
        """Collective: fill the materialised model (and, when resuming, the optimizer and scheduler)
        from the sources that apply; return the train state and what was loaded, for the log.
        Resuming under another global batch (`global_batch`: this run's) is allowed, with a warning.
        A full fine-tuning checkpoint holds the whole model; a LoRA run's (`lora`: the model's LoRA
        handle) holds only what trains, over a base read again from its own source. First, a warning
        if this run's checkpoints (`total_steps`) may not fit the disk."""
        self._lora = lora
        check_room(self.cfg, model, lora, resume_from, total_steps)
        t0 = time.perf_counter()
        loaded = None
        if resume_from is None or lora:
            loaded, self._prepared = load_model_weights(self.cfg, model, self.env)
        if lora:  # no model file or cache holds the adapters; a resumed checkpoint's replace these
            lora.initialise_adapters(model, self.cfg.train.seed, self.env.device)
            # read now, while the base is surely where it was loaded from
            decided_on_rank0(lambda: self.lora_record(model), long_wait=True)
        if resume_from is None:
            return {"step": 0, "tokens_seen": 0}, f"{loaded} in {time.perf_counter() - t0:.1f} s"
        state = self._load(resume_from, model, optimizer, scheduler)
        if state.get("global_batch", global_batch) != global_batch:
            log0(f"warning: global batch {global_batch} != {state['global_batch']} of the checkpoint; the data "
                 "order from here differs from the original run's")
        resumed = f"resumed from {resume_from} (step {state['step']}, saved by {state['world_size']} ranks)"
        return state, f"{resumed if loaded is None else f'{loaded}; {resumed}'} in {time.perf_counter() - t0:.1f} s"

    def _training_state(self, model: nn.Module, optimizer: Optimizer) -> dict:
        """What a checkpoint holds of the model and optimizer: all of it, or with LoRA what trains
        (the frozen base is read again from its source)."""
        weights = get_model_state_dict(model)  # all of it (buffers, a tied head's second name) without LoRA
        if self._lora:
            held = self._lora.checkpointed(model)
            weights = {name: value for name, value in weights.items() if name in held}
        return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer)}

    def _load(self, path: Path, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler) -> dict:
        state = self._training_state(model, optimizer)

        def check() -> None:  # rank 0, said once
            if self._lora:
                self._lora.check_resume(path, read_train_state(path / TRAIN_STATE).get("lora"), self.lora_record(model))
            wrong = shape_mismatches(path, state["model"])
            if wrong:
                raise CheckpointError(f"{path} was written for another model ({len(wrong)} tensors differ, e.g. "
                                      f"{wrong[0]}); resume with the model it was trained from, or set "
                                      "checkpoint.resume=none")
        decided_on_rank0(check)
        read_checkpoint(state, path)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not self._lora))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=False))
        rng_path = path / rng_file(self.env.rank)
        if rng_path.is_file():  # a rank that did not exist in the saving run keeps its fresh seed
            rng.set_state(torch.load(rng_path, weights_only=False))
        return read_train_state(path / TRAIN_STATE)

    def save(self, step: int, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler, train_state: dict,
             blocking: bool = True) -> Path | None:
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
        if (waited := time.perf_counter() - t0) > 1:  # the advice is for periodic saves; a final save waits anyway
            log0(f"checkpoint: waited {waited:.1f} s for the previous save's write"
                 + ("; save less often than the disk writes a checkpoint (checkpoint.every_steps)" if not blocking
                    else " to commit first"))
        final = self.root / f"step-{step}"
        commit = AllRanksCommit(final, self.env, checkpoints=self.root)
        tmp = commit.begin()
        state = self._training_state(model, optimizer)
        in_background = not blocking and self.cfg.checkpoint.async_save
        background, error, digests = None, None, {}
        try:
            # DCP first: its collectives run before any rank can fail alone on the small files.
            if in_background:
                background = self._background.write(state, tmp)
            else:
                digests = write_shards(state, tmp, None, self.env.rank, self.env.world_size)
            torch.save(rng.state(), tmp / rng_file(self.env.rank))
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
            self._background.pending = (commit, background, error)
        else:
            self._commit(commit, error, digests)
        log0(f"saved {final} in {time.perf_counter() - t0:.1f} s" + (" (training blocked; writing on)" if in_background
                                                                     else ""))
        return final

    def lora_record(self, model: nn.Module) -> dict:
        """Rank 0: what this LoRA run's adapters are fitted to (sft/adapters/record.py), read once."""
        if self._lora_record is None:
            self._lora_record = self._lora.record(self.cfg.model, self.cfg.train.seed, model, self._prepared)
        return self._lora_record

    def close(self) -> None:
        """At a run's end, after its last save: the writer thread joined and its group let go."""
        self._background.close()

    def step_done(self, model: nn.Module, optimizer: Optimizer, stopping: bool = False) -> None:
        """Collective, after every optimizer step: commit a background save once every rank has
        written it; after this run's first step, start making the staging buffers (not when the run
        is `stopping`: the stop-save is synchronous)."""
        if self._background.pending is not None and self._background.written_everywhere():
            self.wait()
        if not self._stepped and not stopping:
            self._stepped = True
            if self.cfg.checkpoint.stages_in_host_memory:
                self._background.prepare_staging(self._training_state(model, optimizer))

    def wait(self) -> None:
        """Collective: finish and commit the save in flight, if any (before the next save, and at
        the end of the run)."""
        if self._background.pending is None:
            return
        commit, background, error = self._background.pending
        self._background.pending = None
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
