"""Preemption: SIGTERM / SIGUSR1 ask the run to stop after the current step with a checkpoint.

A handler only sets a flag (nothing unsafe happens inside a signal handler). The training loop
sums the flag over ranks with the step's metrics all-reduce, so every rank sees the request at
the same step, saves together and exits with REQUEUE_EXIT_CODE (sft/checkpoint.py).
"""

from __future__ import annotations

import signal


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
