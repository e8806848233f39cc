"""The run directory `<train.output_dir>/<train.run_name>/`: one launch at a time, and committed
state that only a run which has proven it can start may change.

    RunDirectory(cfg, env).open()    lock it, decide the resume point (nothing is written)
    ... data, model, weights and the resume checkpoint are loaded ...
    run.start(step)                  ready to train: only now is anything in the directory changed
    run.finish()                     the `finished` marker

* Lock: rank 0 holds an advisory lock (`<output_dir>/.<run_name>.lock`, flock) for the run's
  life. A second launch of the same run (a double sbatch, a requeue racing a manual rerun) stops
  with the holder's host, PID and job id. The kernel drops the lock when the holder dies, so a
  lock left by a killed run never blocks the next one; a process that exits removes its lock file
  (still holding the lock, so that no other launch can hold it meanwhile; one that locked the file
  just before it was removed sees that its name is gone and locks a new one).
* A failing start leaves no trace: the directory is created by `start()`, after the config,
  data, model and resume checkpoint were all validated.
* `train.overwrite` on a finished run moves the old run's files into `<run>/overwritten/` at
  `start()` and deletes them only when the new run finishes, so a rerun that fails midway never
  costs the previous result, however often it is relaunched, resumed or restarted before it
  finishes. Resuming from one of the run's own checkpoints (to train further) continues the run
  instead: nothing is moved but its export (below).
* Checkpoints later than the step a run starts from (`checkpoint.resume=none`, or an older
  checkpoint) belong to a line of training this run replaces: they go to `<run>/set-aside/` (and
  so does the export of a finished run trained further, which this run's export will replace),
  never over `overwritten/` or each other, and are deleted when the run finishes too. Damaged
  checkpoints that the resume skipped go to `<run>/damaged/`, kept for inspection (a disk that
  corrupts files is worth a look) and never retried: only the user deletes them.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import os
import shutil
import socket
import time
from pathlib import Path

from sft import atomic
from sft.checkpoint.layout import committed_checkpoints, step_of
from sft.config import Config, ConfigError, to_yaml
from sft.distributed import DistEnv, decided_on_rank0, log0
from sft.export import export_hf
from sft.training.preemption import STOPPED_MARKER

FINISHED = "finished"
EXPORT = "export"  # checkpoint.export_hf: the Hugging Face export of the final checkpoint
OVERWRITTEN = "overwritten"
SET_ASIDE = "set-aside"
DAMAGED = "damaged"
# What a run writes at its top level (besides the checkpoints): moved aside together on overwrite.
_RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml", EXPORT, "tb", "profile", "curves.png", FINISHED,
              STOPPED_MARKER)


class RunDirectory:
    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg, self.env, self.path = cfg, env, cfg.run_dir
        self.checkpoints = cfg.checkpoints_dir
        self._lock_fd: int | None = None

    @property
    def lock_path(self) -> Path:
        return self.path.parent / f".{self.path.name}.lock"

    @property
    def export_dir(self) -> Path:
        return self.path / EXPORT

    @property
    def finished(self) -> bool:
        return (self.path / FINISHED).exists()

    def open(self) -> None:
        """Collective: lock the run directory (rank 0) and check that this run may use it."""
        decided_on_rank0(self._lock_and_check)

    def _lock_and_check(self) -> None:
        parent = self.path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if isinstance(e, FileExistsError):  # mkdir says only that the name exists: stat says why
                try:
                    parent.stat()
                except OSError as why:  # a symlink loop (ELOOP), a dangling link
                    e = why
            raise ConfigError(f"train.output_dir={str(parent)!r}: cannot write there ({e.strerror}); "
                              "choose a writable train.output_dir") from None
        fd = self._lock(self.lock_path)
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, "
                     f"Slurm job {os.environ.get('SLURM_JOB_ID', '-')}\n".encode())
        self._lock_fd = fd  # held until the process exits
        atexit.register(self.release)
        if self.path.exists() and not os.access(self.path, os.W_OK | os.X_OK):
            raise ConfigError(f"{self.path} is not writable; fix its permissions or set another train.run_name")
        if self.finished and not self.cfg.train.overwrite and not self._continues_own_checkpoint():
            raise ConfigError(f"{self.path} holds a finished run; set train.overwrite=true (the old run is kept "
                              "until the new one finishes), another train.run_name, or "
                              "checkpoint.resume=<one of its checkpoints> to train it further")

    def _lock(self, lock: Path) -> int:
        """An open descriptor of `lock`, flock'ed by this process; ConfigError naming the holder."""
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as e:
                raise ConfigError(f"train.output_dir={str(lock.parent)!r}: cannot write there ({e.strerror}); "
                                  "choose a writable train.output_dir") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ConfigError(f"{self.path} is in use by another launch ({holder}); wait for it to end, or "
                                  "set another train.run_name") from None
            except OSError as e:  # a filesystem without locks (e.g. Lustre mounted noflock)
                if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                    raise
                log0(f"warning: {lock.parent} does not support file locks ({e.strerror}): nothing stops a second "
                     "launch of this run from writing into it at the same time")
                return fd
            if _same_file(fd, lock):
                return fd
            os.close(fd)  # its holder removed it as it exited, after we opened it: lock the new one

    def release(self) -> None:
        """Rank 0, at exit: remove the lock file while still holding the lock, then release it."""
        if self._lock_fd is None:
            return
        try:
            if _same_file(self._lock_fd, self.lock_path):
                self.lock_path.unlink()
        except OSError:
            pass  # the next launch reuses it
        os.close(self._lock_fd)
        self._lock_fd = None

    def _continues_own_checkpoint(self) -> bool:
        resume = self.cfg.checkpoint.resume
        return resume not in ("auto", "none") and Path(resume).resolve().parent == self.checkpoints.resolve()

    def resume_auto(self) -> bool:
        """Whether `checkpoint.resume: auto` should look for this run's own checkpoints: not when
        the finished run is about to be overwritten (that starts fresh)."""
        return self.cfg.checkpoint.resume == "auto" and not self.finished

    def start(self, start_step: int, damaged: set[Path]) -> None:
        """Collective, once everything is loaded and the run starts at `start_step` (`damaged`: the
        checkpoints the resume skipped): make the directory this run's own (rank 0 does the work; a
        failure stops every rank alike)."""
        decided_on_rank0(lambda: self._start(start_step, damaged))

    def _start(self, start_step: int, damaged: set[Path]) -> None:
        try:
            if self.finished and not self._continues_own_checkpoint():
                self._move_aside(_RUN_FILES, OVERWRITTEN, "the finished run (train.overwrite)")
            else:
                # Set aside, or retention and `resume: auto` would take them for this run's newest.
                later = [p for p in committed_checkpoints(self.checkpoints) if step_of(p) > start_step]
                broken = [f"checkpoints/{p.name}" for p in later if p in damaged]
                replaced = [f"checkpoints/{p.name}" for p in later if p not in damaged]
                if broken:
                    self._move_aside(broken, DAMAGED, "damaged checkpoints",
                                     "kept for inspection: delete them when you no longer need them")
                if replaced:
                    self._move_aside(replaced, SET_ASIDE, f"checkpoints after step {start_step}")
                if self.cfg.checkpoint.export_hf and (self.path / EXPORT).exists():  # a finished run trained further
                    self._move_aside([EXPORT], SET_ASIDE, "the previous export")
                if (self.path / f"{EXPORT}.tmp").exists():  # an export killed midway: the run owns the name
                    self._move_aside([f"{EXPORT}.tmp"], SET_ASIDE, "an unfinished export")
            (self.path / FINISHED).unlink(missing_ok=True)
            (self.path / STOPPED_MARKER).unlink(missing_ok=True)  # a requeued run is running again
            self.path.mkdir(parents=True, exist_ok=True)
            atomic.write_file(self.path / "config.yaml", to_yaml(self.cfg))
        except OSError as e:
            raise ConfigError(f"{self.path}: cannot prepare the run directory ({e}); check its permissions and free "
                              "space, or set another train.output_dir") from None
        log0(f"run directory {self.path}; resolved config:\n{to_yaml(self.cfg)}")

    def _move_aside(self, names, into: str, what: str,
                    fate: str = "it is deleted when this run finishes") -> None:
        """Move `names` (relative to the run) into `<run>/<into>/`, never over anything already
        there: what an earlier start set aside stays until the run finishes."""
        for name in names:
            if (self.path / name).exists():
                target = self.path / into / name
                for n in itertools.count(2):
                    if not target.exists():
                        break
                    target = self.path / into / f"{name}.{n}"
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.path / name, target)
        log0(f"run directory: {what} moved to {self.path / into}; {fate}")

    def finish(self, final: Path | None) -> None:
        """Rank 0: export the final checkpoint (checkpoint.export_hf), mark the run finished; only now
        drop the run it overwrote."""
        if self.cfg.checkpoint.export_hf:
            t0 = time.perf_counter()
            what = export_hf(final, self.export_dir, self.cfg.checkpoint.export_dtype)
            log0(f"exported {what} to {self.export_dir} in {time.perf_counter() - t0:.1f} s")
        atomic.write_file(self.path / FINISHED, "")
        for replaced in (OVERWRITTEN, SET_ASIDE):
            shutil.rmtree(self.path / replaced, ignore_errors=True)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
