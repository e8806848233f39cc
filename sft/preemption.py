"""Preemption: SIGTERM / SIGUSR1, or a `stop-request` file in the run directory, ask the run to
stop after the current step with a checkpoint.

A handler only sets a flag (nothing unsafe happens inside a signal handler). The training loop
sums the flag over ranks with the step's metrics all-reduce, so every rank sees the request at
the same step and leaves the loop there; the shutdown path commits a checkpoint, then writes the
`stopped` marker (step, signal, time) into the run directory and exits with REQUEUE_EXIT_CODE.

slurm/train.slurm asks through the file rather than a signal: torchrun SIGKILLs its workers 30 s
after forwarding a signal (before torch 2.12 that cannot be changed), and a 7B save takes a
minute. The marker is what the script trusts for a requeue: under torchrun the workers' exit
code does not reach it (torchrun exits 1 whenever a worker fails).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from sft import atomic

# The exit status of a run that stopped on SIGTERM/SIGUSR1 after committing a checkpoint:
# EX_TEMPFAIL, "try again later".
REQUEUE_EXIT_CODE = 75
STOPPED_MARKER = "stopped"
STOP_REQUEST = "stop-request"


class StopRequest:
    """Whether this rank was asked to stop: a signal, or (`stop_file`, watched by rank 0) a stop
    request written after this process started (an older one was for an earlier job)."""

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
