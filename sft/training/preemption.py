"""Preemption: SIGTERM / SIGUSR1, or a `stop-request` file in the run directory, ask the run to
stop with a checkpoint, after the current step and the next; so does the death of the torchrun
that started this worker.

A handler only sets a flag (nothing unsafe happens inside a signal handler). The training loop
sums the flag over ranks with the step's metrics all-reduce, so every rank sees the request at
the same step (it reads that sum once the next step's work is queued) and leaves the loop there;
the shutdown path commits a checkpoint, then writes the `stopped` marker (step, signal, time) into
the run directory and exits with REQUEUE_EXIT_CODE.

slurm/train.slurm asks through the file rather than a signal: torchrun SIGKILLs its workers 30 s
after forwarding a signal (before torch 2.12 that cannot be changed), and a 7B save takes a
minute. The marker is what the script trusts for a requeue: under torchrun the workers' exit
code does not reach it (torchrun exits 1 whenever a worker fails).

torchrun starts each worker in a session of its own, so a launcher killed outright (SIGKILL to its
process group, a supervisor, Ctrl-\\ in a terminal) takes no worker with it: the orphans would go
on training, saving and holding the run's lock, and a rerun would be refused. A worker therefore
watches its parent, the torchrun that started it, in two ways:

* until the training loop begins (`training_begins`), a watcher thread ends the worker within a
  second of the launcher's death, with one line. Nothing has been trained yet, and a worker may be
  waiting for the dead launcher's store (the rendezvous: 30 minutes of retries before it would
  fail, holding its GPU) or for another worker that the same watcher just ended;
* from then on the death asks for a stop like a signal: checked every step, so at most one step
  later, the run stops with a checkpoint (the stop-save commits atomically or not at all, and
  needs nothing from the launcher).

A plain `python train.py` is left alone: its parent is a shell, and `nohup` is a choice.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from sft import atomic

# The exit status of a run that stopped on SIGTERM/SIGUSR1 after committing a checkpoint:
# EX_TEMPFAIL, "try again later".
REQUEUE_EXIT_CODE = 75
STOPPED_MARKER = "stopped"
STOP_REQUEST = "stop-request"
LAUNCHER_GONE = "the exit of its torchrun"
# The launcher, read as this module is imported (before the rendezvous and the loading, during
# which the launcher may already die). torchrun sets TORCHELASTIC_RUN_ID in its workers' environment.
_LAUNCHER = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
# How often the watcher thread looks at the parent before training starts.
WATCH_INTERVAL_S = 0.5


def _orphaned() -> bool:
    return _LAUNCHER is not None and os.getppid() != _LAUNCHER  # re-parented to init or a subreaper


class StopRequest:
    """Whether this rank was asked to stop: a signal, (`stop_file`, watched by rank 0) a stop
    request written after this process started (an older one was for an earlier job), or, under
    torchrun, the launcher's death. Created first thing, before the rendezvous: until
    `training_begins`, a dead launcher ends the process (module docstring)."""

    def __init__(self, stop_file: Path, started_at: float,
                 signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.signal_name: str | None = None
        self.stop_file = stop_file if int(os.environ.get("RANK", "0")) == 0 else None
        self.started_at = started_at
        for sig in signals:
            signal.signal(sig, self._handle)
        self._training = threading.Event()  # set by training_begins: the loop handles a dead launcher
        if _LAUNCHER is not None:
            threading.Thread(target=self._exit_if_orphaned_before_training, name="launcher-watch", daemon=True).start()

    def _handle(self, signum: int, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def _exit_if_orphaned_before_training(self) -> None:
        while not _orphaned():
            if self._training.wait(WATCH_INTERVAL_S):
                return
        if int(os.environ.get("RANK", "0")) == 0:  # every worker sees it; one line says it
            print(f"error: the torchrun that started this run (pid {_LAUNCHER}) is gone, before this launch's first "
                  "training step: its workers stop; the same command resumes from the run's last checkpoint, if any",
                  file=sys.stderr, flush=True)
        # Every worker sees the death within one interval. Each falls silent now and exits only once
        # all have: a worker that exited sooner would fail the others' collectives, with tracebacks.
        # os._exit: the main thread may be blocked on the dead launcher's store.
        silent = os.open(os.devnull, os.O_WRONLY)
        os.dup2(silent, 1)
        os.dup2(silent, 2)
        time.sleep(3 * WATCH_INTERVAL_S)
        os._exit(1)

    def training_begins(self) -> None:
        """From the first step on, the loop handles a dead launcher: a stop with a checkpoint."""
        self._training.set()

    @property
    def requested(self) -> bool:
        if self.signal_name is None and _orphaned():
            self.signal_name = LAUNCHER_GONE
        if self.signal_name is None and self.stop_file is not None:
            try:
                if self.stop_file.stat().st_mtime >= self.started_at:
                    self.signal_name = self.stop_file.name
            except FileNotFoundError:
                pass
        return self.signal_name is not None


def write_stopped_marker(run_dir: Path, step: int, signal_name: str | None) -> None:
    """After the stop checkpoint is committed: what the requeue logic reads. The stop request, if
    any, has done its work: removed, so that no file is left that asks a later run to stop."""
    atomic.write_file(run_dir / STOPPED_MARKER, json.dumps({"step": step, "signal": signal_name or "another rank's",
                                                             "time": time.time()}) + "\n")
    (run_dir / STOP_REQUEST).unlink(missing_ok=True)
