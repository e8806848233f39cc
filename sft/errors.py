"""Errors the user must fix, and the entry point that reports them: one line, no traceback.

Every entry point (train.py, `python -m sft.<tool>`) runs through `run_command`. Code that finds
bad input raises a `UserError` (or a subclass named for its room: ConfigError, DataError,
ModelError, CheckpointError, ...) whose message names the key, file or row and the fix.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import time
from collections.abc import Callable


class UserError(Exception):
    """Bad input or state that the user must fix: train.py prints the message as one line (no
    traceback) and exits with status 2. `shared` marks an error that every rank raises alike
    (decided on rank 0, or from the same config): rank 0 alone reports it."""

    shared = False


# How long ranks other than 0 wait before exiting on a shared error (torchrun ends them sooner).
SHARED_ERROR_GRACE_S = 5.0

# Errors that are not bad input but that an entry point can explain in one line once it knows enough
# (train.py: running out of GPU memory, with the planner's prediction): kind -> its explanation.
_EXPLAINED: dict[type[BaseException], Callable[[BaseException], UserError]] = {}


def explain(kind: type[BaseException], explanation: Callable[[BaseException], UserError]) -> None:
    """From now on, `run_command` reports a `kind` error as the UserError `explanation` makes of it."""
    _EXPLAINED[kind] = explanation


def run_command(main: Callable[[], int | None], end_process: bool = True) -> None:
    """Run an entry point (train.py, `python -m sft.<tool>`) and exit with its status. Bad input is
    one line on stderr and exit status 2, never a traceback; under torchrun an error every rank
    raises alike (`shared`) is printed once, by rank 0.

    Once `main` has returned, everything it owns is closed (logs, checkpoints, exports, the process
    groups), and the process ends there (`end_process`; a test calling an entry point in its own
    process passes False and gets the SystemExit): the atexit handlers run (the run directory's
    lock, the compile workers), then `os._exit`, without the interpreter's teardown. Why: in that
    teardown, torch's and gloo's C++ objects are destroyed in no set order, and about one 2-rank
    launch in 75 under load aborted there after a finished run ('terminate called without an
    active exception', exit -6: a requeue or a failed job under Slurm) — issue #56.
    """
    # A failed command exits through the interpreter's teardown, whose last garbage collection walks
    # every object torch, transformers and their imports created: ~1 s on the 2-core CPU machine,
    # for nothing (no finaliser of ours is left to run then: logs, checkpoints and exports are
    # closed explicitly). Frozen, they are skipped (0.17 s). Registered here, it touches only
    # processes that run an entry point (in-process test calls register it again: harmless).
    atexit.register(gc.freeze)
    try:
        try:
            status = main()
            if end_process:
                _end_process(status or 0)
            sys.exit(status)
        except tuple(_EXPLAINED) as e:  # noqa: B030 -- the kinds registered so far
            raise next(explanation(e) for kind, explanation in _EXPLAINED.items() if isinstance(e, kind)) from None
    except UserError as e:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or not e.shared:
            print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops every rank as soon as one exits: the others wait for rank 0, which
            # raises the same error, to print it (without this the line was lost now and then).
            # Once it has, torchrun's SIGTERM ends the wait: not the stop-save handler's to catch.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(SHARED_ERROR_GRACE_S)
        sys.exit(2)


def _end_process(status: int) -> None:
    """Exit with `status` now: stdio flushed, the atexit handlers run, no interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(status)
