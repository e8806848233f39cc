"""Asynchronous saves: training waits only while the sharded state is copied into host buffers;
a writer thread writes the files over a gloo group of its own, so that the background collectives
do not interleave with the training loop's. The buffers are made and pinned after the first step,
off the training path, so that the first save, too, only copies."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sft.checkpoint.commit import AllRanksCommit, write_shards
from sft.checkpoint.staging import HostStaging, tensors_of
from sft.config import Config
from sft.distributed import DistEnv, local_part, log0


class BackgroundSaves:
    """The writer thread, its group, the host buffers, and the save in flight (at most one)."""

    def __init__(self, cfg: Config, env: DistEnv):
        self.env = env
        # Made now, at start-up (a collective): making a group needs the launcher's store, which a
        # stop-save must not (sft/training/preemption.py). The thread works on this rank's GPU
        # (pinning from another device's context would start a CUDA context there).
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
        # The save in flight: its commit, the background write, and this rank's own error, if any.
        self.pending: tuple[AllRanksCommit, Future | None, BaseException | None] | None = None

    def prepare_staging(self, state: dict) -> None:
        """Once after the first step (when Adam's moments exist): make and pin the host buffers for
        `state` on the writer thread while training goes on."""
        staged = sum(local_part(tensor).nbytes for tensor in tensors_of(state)) / 2**30
        log0(f"checkpoint: asynchronous saves keep {staged:.1f} GiB per rank of host memory for staging "
             "(rank 0's share; pinned where the state is on the GPU)")
        self._staging_job = self._writer.submit(self._staging.allocate, state, self.env.rank)

    def write(self, state: dict, tmp: Path) -> Future:
        """Copy `state` to the host buffers (training waits for this) and write it to `tmp` on the
        writer thread. The previous write has finished (save() waited for it): the buffers are free."""
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

    def written_everywhere(self) -> bool:
        """Collective, while a save is in flight: whether every rank's background write has finished
        (never waits for the writes)."""
        _, background, _ = self.pending
        done = torch.tensor([float(background is None or background.done())], device=self.env.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def close(self) -> None:
        """The writer thread joined and the group let go (distributed.shut_down destroys it)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self._writer = self._group = self._staging_job = None
