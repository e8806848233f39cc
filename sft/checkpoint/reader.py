"""A DCP checkpoint read at the page cache's speed: `read_checkpoint`, `dcp.load` through `CheckpointReader`.

torch's FileSystemReader unpickles each saved tensor's `torch.save` record from a Python file object
into a new tensor in pageable host memory and copies that into its destination: onto a GPU, a pageable
copy the host waits for. A resume of 22.2 GB read at 3 GB/s where the same bytes as safetensors files load
at 5 (docs/BENCHMARKS.md, issue #58). `CheckpointReader` learns where each record's data lies from
torch.load on the meta device (torch's own parser: the record's pickle and zip directory, no data), then
reads the data with positional reads straight into the destination, in file order, READ_THREADS at a
time: on the CPU into the tensor, onto a GPU through pinned staging buffers copied while the next chunk
is read (sft/hub/safetensors_files.py). Bytes items, transformed records, a torch without the meta
offsets or a saved view that is not one contiguous run take torch's own path.
"""

from __future__ import annotations

import io
import os
import pickle
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import IO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future as TorchFuture

from sft.checkpoint.layout import CheckpointError
from sft.hub.safetensors_files import PositionalReads
from sft.hub.weights import READ_THREADS


def _record_data_offset(saved: torch.Tensor) -> int | None:
    """Where torch.load, on the meta device, found a record's data (from the record's start); None
    on a torch that does not say."""
    return getattr(saved.untyped_storage(), "_checkpoint_offset", None)


def _saved_layout(record: IO[bytes], start: int, item: ReadItem) -> tuple[int, torch.Tensor] | None:
    """(the file offset of the data `item` reads, the saved tensor's slice it reads, on the meta device),
    for the record that begins at `start` of its file (`record`: a view of it, FileSystemReader's), or
    None where it is not one contiguous run of a dense tensor's data this can read directly."""
    try:
        saved = torch.load(record, map_location="meta", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError):  # not a torch.save record (another serialisation)
        return None
    if not isinstance(saved, torch.Tensor) or saved.layout != torch.strided:
        return None
    data = _record_data_offset(saved)
    if data is None:
        return None
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
        saved = saved.narrow(dim, offset, length)
    if not saved.is_contiguous():
        return None
    return start + data + saved.storage_offset() * saved.element_size(), saved


class CheckpointReader(dcp.FileSystemReader):
    """FileSystemReader whose tensors are read straight into their destinations (the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._reads = PositionalReads()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        elsewhere: list[ReadItem] = []
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="checkpoint") as pool:
            for relative_path, items in per_file.items():
                file = str(Path(self.path) / relative_path)
                items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
                with open(file, "rb") as stream:
                    reads: list[tuple[ReadItem, torch.Tensor, Future]] = []
                    try:
                        for item in items:
                            if (read := self._submit(pool, stream, item, planner, file)) is None:
                                elsewhere.append(item)
                            else:
                                reads.append(read)
                    finally:  # every read submitted is done (or failed) before its file closes
                        wait([future for _, _, future in reads])
                for item, target, future in reads:
                    future.result()
                    planner.commit_tensor(item, target)
        if elsewhere:
            super().read_data(LoadPlan(elsewhere), planner).wait()
        done: TorchFuture = TorchFuture()
        done.set_result(None)
        return done

    def _submit(self, pool: ThreadPoolExecutor, stream: io.BufferedReader, item: ReadItem, planner: LoadPlanner,
                file: str) -> tuple[ReadItem, torch.Tensor, Future] | None:
        """The read of `item` straight into its destination, submitted to `pool`; None for torch's reader."""
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            return None
        found = _saved_layout(self._slice_file(stream, info), info.offset, item)
        if found is None:
            return None
        offset, saved = found
        target = planner.resolve_tensor(item).detach()
        if target.shape != saved.shape:
            raise CheckpointError(f"{file}: {item.storage_index.fqn} is saved as {tuple(saved.shape)} where "
                                  f"{tuple(target.shape)} is read; resume with the model it was trained from")
        return item, target, pool.submit(self._read, stream.fileno(), offset, saved, target, file)

    def _read(self, descriptor: int, offset: int, saved: torch.Tensor, target: torch.Tensor, file: str) -> None:
        if target.dtype == saved.dtype and target.is_contiguous():
            self._reads.into(descriptor, offset, target, file)
            return
        read = torch.empty(saved.shape, dtype=saved.dtype)  # a cast (a bf16 LoRA base from a float32 cache)
        self._reads.into(descriptor, offset, read, file)
        target.copy_(read)


def read_checkpoint(state: dict, path: str | os.PathLike, no_dist: bool = False) -> None:
    """`dcp.load(state, checkpoint_id=path)` through CheckpointReader."""
    dcp.load(state, checkpoint_id=path, storage_reader=CheckpointReader(path), no_dist=no_dist)
