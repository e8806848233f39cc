"""Preemption: SIGTERM / SIGUSR1, or a `stop-request` file in the run directory, ask the run to
stop after the current step with a checkpoint; so does the death of the torchrun that started
this worker.

A handler only sets a flag (nothing unsafe happens inside a signal handler). The training loop
sums the flag over ranks with the step's metrics all-reduce, so every rank sees the request at
the same step and leaves the loop there; the shutdown path commits a checkpoint, then writes the
`stopped` marker (step, signal, time) into the run directory and exits with REQUEUE_EXIT_CODE.

slurm/train.slurm asks through the file rather than a signal: torchrun SIGKILLs its workers 30 s
after forwarding a signal (before torch 2.12 that cannot be changed), and a 7B save takes a
minute. The marker is what the script trusts for a requeue: under torchrun the workers' exit
code does not reach it (torchrun exits 1 whenever a worker fails).

torchrun starts each worker in a session of its own, so a launcher killed outright (SIGKILL to its
process group, a supervisor, Ctrl-\\ in a terminal) takes no worker with it: the orphans would go
on training, saving and holding the run's lock, and a rerun would be refused. A worker therefore
watches its parent: once it is no longer the torchrun that started it, the run stops as on a
signal (checked every step, so at most one step later; the stop-save commits atomically or not
at all). A plain `python train.py` is left alone: its parent is a shell, and `nohup` is a choice.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from sft import atomic

# The exit status of a run that stopped on SIGTERM/SIGUSR1 after committing a checkpoint:
# EX_TEMPFAIL, "try again later".
REQUEUE_EXIT_CODE = 75
STOPPED_MARKER = "stopped"
STOP_REQUEST = "stop-request"
LAUNCHER_GONE = "the exit of its torchrun"
# The launcher, read as this module is imported (train.py imports it first thing): before the
# rendezvous and the loading, during which the launcher may already die. torchrun sets
# TORCHELASTIC_RUN_ID in its workers' environment.
_LAUNCHER = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


class StopRequest:
    """Whether this rank was asked to stop: a signal, (`stop_file`, watched by rank 0) a stop
    request written after this process started (an older one was for an earlier job), or, under
    torchrun, the launcher's death."""

    def __init__(self, stop_file: Path | None, started_at: float,
                 signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.signal_name: str | None = None
        self.stop_file, self.started_at = stop_file, started_at
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        if self.signal_name is None and _LAUNCHER is not None and os.getppid() != _LAUNCHER:
            self.signal_name = LAUNCHER_GONE  # orphaned: re-parented to init or a subreaper
        if self.signal_name is None and self.stop_file is not None:
            try:
                if self.stop_file.stat().st_mtime >= self.started_at:
                    self.signal_name = self.stop_file.name
            except FileNotFoundError:
                pass
        return self.signal_name is not None


def write_stopped_marker(run_dir: Path, step: int, signal_name: str | None) -> None:
    """After the stop checkpoint is committed: what the requeue logic reads."""
    atomic.write_file(run_dir / STOPPED_MARKER, json.dumps({"step": step, "signal": signal_name or "another rank's",
                                                             "time": time.time()}) + "\n")
