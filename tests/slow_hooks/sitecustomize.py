"""Test-only slowdowns, loaded by Python at start-up when this folder is on PYTHONPATH.

SFT_TEST_SLOW_SAVE_S=N        every torch.distributed.checkpoint.save first sleeps N seconds
SFT_TEST_SLOW_STEP_S=N        every optimizer step (AdamW) first sleeps N seconds
SFT_TEST_DIE_IN_EXPORT=1      the process dies (exit 9, as a kill -9) as it writes an export's first
                              safetensors file (a kill during the export)
SFT_TEST_STOP_REQUEST_AT=N:F  the N-th optimizer step (AdamW) of the process first writes the file F
                              (a run's stop request, written during a known step)
SFT_TEST_SLOW_TOKENIZE_S=N    rank 0's tokenising datasets map (desc "tokenising ...") first sleeps N s
SFT_TEST_SLOW_RENDEZVOUS_S=N  every torchrun worker sleeps N s before it joins the process group
SFT_TEST_MARKS=DIR            the two above first write DIR/<what>.rank<r> (what: rendezvous, tokenising),
                              so a test knows the workers are there
SFT_TEST_FULL_DISK_RANK=R     rank R's checkpoint RNG file fails to save with ENOSPC (a full disk)
SFT_TEST_SAVE_BUG_RANK=R      rank R's checkpoint RNG file fails to save with a KeyError (a bug)
SFT_TEST_SHARDS_FAIL=R:HOW    rank R's DCP shard files fail to write: HOW is no-space (ENOSPC),
                              short-write (all torch.save says of a write that did not go through,
                              on a disk with space: a quota, an I/O error), short-write-full-disk
                              (the same, and the disk reports no free space) or bug (a KeyError)
"""

import os
import time

if os.environ.get("SFT_TEST_SLOW_SAVE_S"):
    import torch.distributed.checkpoint as dcp

    _save = dcp.save

    def _slow_save(*args, **kwargs):
        time.sleep(float(os.environ["SFT_TEST_SLOW_SAVE_S"]))
        return _save(*args, **kwargs)

    dcp.save = _slow_save

if os.environ.get("SFT_TEST_SLOW_STEP_S"):
    import torch

    _step = torch.optim.AdamW.step

    def _slow_step(*args, **kwargs):
        time.sleep(float(os.environ["SFT_TEST_SLOW_STEP_S"]))
        return _step(*args, **kwargs)

    torch.optim.AdamW.step = _slow_step

if os.environ.get("SFT_TEST_DIE_IN_EXPORT"):
    import safetensors.torch

    _save_file = safetensors.torch.save_file

    def _dying_save_file(tensors, filename, *args, **kwargs):
        if os.path.basename(os.path.dirname(str(filename))).endswith(".tmp"):  # export.tmp/, not a checkpoint
            _save_file(dict(list(tensors.items())[:1]), filename, *args, **kwargs)  # part of it, then gone
            os._exit(9)
        return _save_file(tensors, filename, *args, **kwargs)

    safetensors.torch.save_file = _dying_save_file

if os.environ.get("SFT_TEST_STOP_REQUEST_AT"):
    import torch

    _steps, (_at, _stop_file) = [0], os.environ["SFT_TEST_STOP_REQUEST_AT"].split(":", 1)
    _step_of_stop = torch.optim.AdamW.step

    def _step_that_requests_a_stop(*args, **kwargs):
        _steps[0] += 1
        if _steps[0] == int(_at):
            open(_stop_file, "w").close()
        return _step_of_stop(*args, **kwargs)

    torch.optim.AdamW.step = _step_that_requests_a_stop


def _mark(what: str) -> None:
    if os.environ.get("SFT_TEST_MARKS"):
        open(os.path.join(os.environ["SFT_TEST_MARKS"], f"{what}.rank{os.environ['RANK']}"), "w").close()


if os.environ.get("SFT_TEST_SLOW_TOKENIZE_S") and os.environ.get("RANK") == "0":
    import datasets

    _map = datasets.Dataset.map

    def _slow_map(self, *args, **kwargs):
        if str(kwargs.get("desc", "")).startswith("tokenising"):
            _mark("tokenising")
            time.sleep(float(os.environ["SFT_TEST_SLOW_TOKENIZE_S"]))
        return _map(self, *args, **kwargs)

    datasets.Dataset.map = _slow_map

if os.environ.get("SFT_TEST_SLOW_RENDEZVOUS_S") and "TORCHELASTIC_RUN_ID" in os.environ:  # workers, not torchrun
    import torch.distributed as dist

    _init_process_group = dist.init_process_group

    def _slow_init_process_group(*args, **kwargs):
        _mark("rendezvous")
        time.sleep(float(os.environ["SFT_TEST_SLOW_RENDEZVOUS_S"]))
        return _init_process_group(*args, **kwargs)

    dist.init_process_group = _slow_init_process_group

_RANK = os.environ.get("RANK", "-")
if _RANK in (os.environ.get("SFT_TEST_FULL_DISK_RANK"), os.environ.get("SFT_TEST_SAVE_BUG_RANK")):
    import errno

    import torch

    _torch_save = torch.save

    def _failing_save(obj, f, *args, **kwargs):
        if str(f).endswith(f"rng-rank{_RANK}.pt"):  # this rank's own checkpoint file
            if os.environ.get("SFT_TEST_FULL_DISK_RANK") == _RANK:
                raise OSError(errno.ENOSPC, "No space left on device")
            raise KeyError(type)
        return _torch_save(obj, f, *args, **kwargs)

    torch.save = _failing_save

_SHARDS_RANK, _, _SHARDS_HOW = os.environ.get("SFT_TEST_SHARDS_FAIL", "").partition(":")
if _SHARDS_RANK == _RANK:
    import errno
    import shutil

    from torch.distributed.checkpoint import FileSystemWriter

    def _failing_write(self, plan, planner):
        if _SHARDS_HOW == "no-space":
            raise OSError(errno.ENOSPC, "No space left on device")
        if _SHARDS_HOW == "short-write-full-disk":  # the disk is full from now on
            disk_usage = shutil.disk_usage
            shutil.disk_usage = lambda path: disk_usage(path)._replace(free=0)
        if _SHARDS_HOW.startswith("short-write"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        raise KeyError(type)

    if _SHARDS_HOW not in ("no-space", "short-write", "short-write-full-disk", "bug"):
        raise ValueError(f"SFT_TEST_SHARDS_FAIL: unknown failure {_SHARDS_HOW!r}")
    FileSystemWriter.write_data = _failing_write
