"""The all-ranks commit: every rank writes its part of a checkpoint into `<final>.tmp`; once all
have, rank 0 commits it as `final` (sft.atomic), with the digests of every file. If any rank's write
fails, the .tmp is removed and every rank raises the same one-line CheckpointError, naming the
failed rank's cause as that rank judged it (the disk's, or a bug's, whose traceback is kept); what
was committed before stays as it was."""

from __future__ import annotations

import errno
import json
import shutil
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from sft import atomic
from sft.checkpoint.layout import DIGESTS, CheckpointError, committed_checkpoints, data_files, digest
from sft.distributed import DistEnv, decided_on_rank0


def write_shards(state: dict, tmp: Path, group: dist.ProcessGroup | None, rank: int, world_size: int) -> dict:
    """Collective: write the sharded state (DCP) into `tmp`; return the digests of this rank's share
    of the data files, all of which exist once dcp.save returns on any rank."""
    dcp.save(state, checkpoint_id=tmp, process_group=group)
    return {data.name: digest(data) for data in data_files(tmp, rank, world_size)}


# What a save can raise: DCP reports any rank's failure as a CheckpointException, a BaseException.
SAVE_FAILURES = (Exception, CheckpointException)


def _causes(e: BaseException):
    """A rank's error in a failed save and the errors it was raised from (torch.save buries the
    OSError)."""
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


# A filesystem with less free space than this is full for a checkpoint.
_NEARLY_FULL_BYTES = 1 << 30
# How torch.save reports a write that did not go through (a full disk or quota, an I/O error):
# "... file write failed", or only a short write ("unexpected pos 704 vs 598").
_FAILED_WRITE = ("write failed", "unexpected pos")


def _failed_write(e: BaseException) -> bool:
    return any(isinstance(c, OSError) or any(text in str(c) for text in _FAILED_WRITE) for c in _causes(e))


def _no_space(e: BaseException, directory: Path) -> bool:
    """Whether a failed write into `directory` ran out of disk space or quota."""
    if any((isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left on device" in str(c)
           for c in _causes(e)):
        return True
    # A failed write does not always say why (and DCP hands each rank's error over without what
    # it was raised from): the disk does.
    try:
        return _failed_write(e) and shutil.disk_usage(directory).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


@dataclass(frozen=True)
class SaveFailure:
    """One rank's judgement of a failed save (`AllRanksCommit._judge`)."""
    others_only: bool
    """this rank's own part succeeded: the failure it saw is another rank's, which that rank judges"""
    rank: int
    """the rank that failed"""
    cause: str
    disk: bool
    """the disk is to blame (full, or a write that did not go through), not a bug"""


class AllRanksCommit:
    """Collective context: every rank writes its part into `<final>.tmp`; once all have, rank 0
    commits it as `final` (sft.atomic). If any rank's write fails, the .tmp is removed and every
    rank raises the same CheckpointError; what was committed before stays as it was (the error
    names the newest committed checkpoint under `checkpoints`, if given)."""

    def __init__(self, final: Path, env: DistEnv, checkpoints: Path | None = None):
        self.final, self.env, self.checkpoints = final, env, checkpoints
        self.tmp = final.with_name(final.name + ".tmp")

    def begin(self) -> Path:
        """Collective: create `<final>.tmp` for every rank to write into."""
        def make() -> None:
            try:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp.mkdir(parents=True)
            except OSError as e:
                raise CheckpointError(f"cannot create {self.tmp}: {e.strerror}; check the permissions and free "
                                      "space of train.output_dir") from None
        decided_on_rank0(make)
        return self.tmp

    def finish(self, error: BaseException | None, digests: dict | None = None) -> None:
        """Collective: commit (with every rank's `digests` of its data files in digests.json), or
        (if `error`, or another rank's) remove the .tmp and raise the same error on every rank,
        naming the lowest failed rank's cause as that rank judged it."""
        mine = None
        if error is not None:
            try:
                mine = self._judge(error)
            except Exception as e:  # never skip the collective below: the other ranks wait in it
                mine = SaveFailure(False, self.env.rank, f"{type(error).__name__} (judging it failed: {e!r})", False)
        reports: list = [None] * self.env.world_size
        dist.all_gather_object(reports, (mine, digests or {}))
        failed = [failure for failure, _ in reports if failure is not None]
        if not failed:
            everyone = {name: digest for _, share in reports for name, digest in share.items()}
            decided_on_rank0(lambda: self._commit(everyone))
            return
        if self.env.is_main:
            shutil.rmtree(self.tmp, ignore_errors=True)
        # The failed rank's own judgement first (its disk, its traceback), then the lowest rank.
        first = min(failed, key=lambda failure: (failure.others_only, failure.rank))
        raise self._error(first.cause if self.env.world_size == 1 else f"rank {first.rank}: {first.cause}", first.disk)

    def __enter__(self) -> Path:
        return self.begin()

    def __exit__(self, kind, error, _tb) -> None:
        self.finish(error)

    def _commit(self, digests: dict) -> None:
        try:
            if digests:  # the ranks' data files, and here every other file (.metadata, RNG states, ...)
                others = [p for p in self.tmp.rglob("*") if p.is_file() and p.suffix != ".distcp"]
                digests = {**digests, **{str(p.relative_to(self.tmp)): digest(p) for p in others}}
                (self.tmp / DIGESTS).write_text(json.dumps(digests, indent=1, sort_keys=True))
            atomic.commit(self.tmp, self.final)
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise self._error(self._cause(e, _no_space(e, self.tmp.parent)), on_disk=True) from None

    def _judge(self, error: BaseException) -> SaveFailure:
        """This rank's view of a failed save. A rank judges its own failure, against its own disk
        (node-local disks differ); DCP also hands it the other ranks' errors, which those ranks
        judge, so a rank whose own part succeeded ranks behind them."""
        rank, stack, others, first = self.env.rank, None, False, True
        if isinstance(error, CheckpointException) and error.failures:
            others = rank not in error.failures
            rank = min(error.failures) if others else rank
            first = rank == min(error.failures)
            error, stack = error.failures[rank]
        no_space = _no_space(error, self.tmp.parent)
        on_disk = no_space or _failed_write(error)
        if not on_disk and not others and first:
            # Not the disk: a bug, here or in a library. The rank the error names keeps its
            # traceback (DCP hands the error over without it, but with its stack).
            if stack is None:
                traceback.print_exception(error)
            else:
                print(f"Traceback (most recent call last), rank {rank}:\n" + "".join(traceback.format_list(stack))
                      + "".join(traceback.format_exception_only(error)), end="", file=sys.stderr, flush=True)
        return SaveFailure(others, rank, self._cause(error, no_space), on_disk)

    def _cause(self, error: BaseException, no_space: bool) -> str:
        if no_space:
            return f"no space left on {self.tmp.parent}"
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"

    def _error(self, cause: str, on_disk: bool) -> CheckpointError:
        previous = committed_checkpoints(self.checkpoints) if self.checkpoints else []
        kept = f"; the previous checkpoint {previous[0]} is intact" if previous else ""
        fix = ("free space (or quota) or fix the permissions of train.output_dir" if on_disk else
               "not a disk problem: its traceback is above; set checkpoint.async_save=false if it is in the "
               "asynchronous save, and report it")
        error = CheckpointError(f"saving {self.final} failed ({cause}){kept}; {fix}, then rerun: the run resumes "
                                "from its last checkpoint")
        error.shared = True  # every rank raises it
        return error
