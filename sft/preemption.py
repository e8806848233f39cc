"""Preemption: SIGTERM / SIGUSR1 ask the run to stop after the current step with a checkpoint.

A handler only sets a flag (nothing unsafe happens inside a signal handler). The training loop
sums the flag over ranks with the step's metrics all-reduce, so every rank sees the request at
the same step and leaves the loop there; the shutdown path commits a checkpoint, then writes the
`stopped` marker (step, signal, time) into the run directory and exits with REQUEUE_EXIT_CODE.
The marker is what slurm/train.slurm trusts for a requeue: under torchrun the workers' exit code
does not reach the script (torchrun exits 1 whenever a worker fails).
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


class StopRequest:
    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.signal_name: str | None = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


def write_stopped_marker(run_dir: Path, step: int, signal_name: str | None) -> None:
    """After the stop checkpoint is committed: what the requeue logic reads."""
    atomic.write_file(run_dir / STOPPED_MARKER, json.dumps({"step": step, "signal": signal_name or "another rank's",
                                                             "time": time.time()}) + "\n")
