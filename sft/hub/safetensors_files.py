"""Tensors out of safetensors files at the speed of the page cache: each file's header parsed once, a
tensor's bytes (a shard's rows of it) read with positional reads straight into the tensor on the CPU,
or through pinned staging buffers copied to the GPU while the next chunk is read.

Why not safetensors' own `safe_open`: it memory-maps the file, so every 4 KiB page read is a page fault
in this process and stays mapped until the file is closed, and each open parses the whole header
again (tens of thousands of entries in a published MoE checkpoint). A positional read (`os.preadv`)
copies from the page cache in one system call per chunk and lets go of the GIL, so several threads
read at once (sft/hub/weights.py: `read_many`).

The format: 8 bytes (little-endian) giving the header's length, the header (JSON: per tensor its
dtype, shape and [begin, end) offsets in the data that follows it), then the data.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# Bytes a thread stages in pinned host memory per copy to a GPU (two buffers a thread, taking turns).
STAGING_BYTES = 32 * 2**20


class DamagedFile(Exception):
    """A file that is not safetensors or is shorter than its header says (the message says how)."""

    def __init__(self, file: str, reason: str):
        super().__init__(reason)
        self.file = file


@dataclass(frozen=True)
class Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # the tensor's first byte in its file
    end: int


def read_header(path: Path) -> tuple[dict, int]:
    """(the header's entries, the offset of the data) of the safetensors file at `path`."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, struct.error) as e:
        raise DamagedFile(path.name, f"{type(e).__name__}: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + length


class SafetensorsFiles:
    """The tensors of a checkpoint's safetensors `files` (names relative to `root`), by name."""

    def __init__(self, root: Path, files: list[str]):
        self.root = root
        self.entries: dict[str, Entry] = {}
        for file in files:
            header, data = read_header(root / file)
            size = (root / file).stat().st_size
            for name, info in header.items():
                try:
                    begin, end = (data + offset for offset in info["data_offsets"])
                    entry = Entry(file, DTYPES[info["dtype"]], tuple(info["shape"]), begin, end)
                except (KeyError, TypeError, ValueError) as e:
                    raise DamagedFile(file, f"its header's entry {name!r} is unreadable ({type(e).__name__}: "
                                            f"{e})") from None
                if end > size or end - begin != math.prod(entry.shape) * entry.dtype.itemsize:
                    raise DamagedFile(file, f"{name!r} lies beyond the file's {size} bytes or has the wrong "
                                            "size (a truncated download?)")
                self.entries[name] = entry
        self._descriptors: dict[str, int] | None = None  # the files `reading` keeps open
        self._lock = threading.Lock()
        self._staging = threading.local()  # each thread's pinned buffers

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Within it, each file is opened once (a descriptor, no header parsed again), and closed at the end."""
        self._descriptors = {}
        try:
            yield
        finally:
            descriptors, self._descriptors = self._descriptors, None
            for descriptor in descriptors.values():
                os.close(descriptor)

    @contextlib.contextmanager
    def _descriptor(self, file: str) -> Iterator[int]:
        if self._descriptors is None:
            descriptor = os.open(self.root / file, os.O_RDONLY)
            try:
                yield descriptor
            finally:
                os.close(descriptor)
            return
        with self._lock:
            if file not in self._descriptors:
                self._descriptors[file] = os.open(self.root / file, os.O_RDONLY)
            descriptor = self._descriptors[file]
        yield descriptor

    def read(self, name: str, index, device: torch.device) -> torch.Tensor:
        """Slice `index` (a tuple of slices, or `...`) of tensor `name`, on `device`: only the rows of its
        first dimension that the slice takes are read."""
        entry = self.entries[name]
        index = () if index is Ellipsis else tuple(index)
        first = index[0] if index else slice(None)
        if not entry.shape or first.step not in (None, 1):
            begin, end, rest = 0, entry.shape[0] if entry.shape else 0, index
        else:
            begin, end, _ = first.indices(entry.shape[0])
            end, rest = max(begin, end), index[1:]
        row_bytes = math.prod(entry.shape[1:]) * entry.dtype.itemsize
        tensor = torch.empty((end - begin, *entry.shape[1:]) if entry.shape else (), dtype=entry.dtype, device=device)
        with self._descriptor(entry.file) as descriptor:
            self._read_into(descriptor, entry, entry.begin + begin * row_bytes, tensor)
        return tensor[(slice(None), *rest)] if entry.shape and rest else tensor[rest] if rest else tensor

    def _read_into(self, descriptor: int, entry: Entry, offset: int, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1).view(torch.uint8)
        if tensor.device.type == "cpu":
            _read_exactly(descriptor, memoryview(flat.numpy()), offset, entry.file)
            return
        staging = self._staging  # this thread's: pinned, so the copy to the GPU runs while the next chunk is read
        if not hasattr(staging, "buffers"):
            with torch.cuda.device(tensor.device):  # pinned in this rank's GPU's context (a thread starts on GPU 0's)
                self._staging.buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
                                         for _ in range(2)]
            self._staging.copied, self._staging.turn = [None, None], 0
        stream = torch.cuda.current_stream(tensor.device)
        for start in range(0, flat.numel(), STAGING_BYTES):
            size, turn = min(STAGING_BYTES, flat.numel() - start), staging.turn
            self._staging.turn ^= 1
            if staging.copied[turn] is not None:
                staging.copied[turn].synchronize()  # this buffer's previous copy has left it
            buffer = staging.buffers[turn][:size]
            _read_exactly(descriptor, memoryview(buffer.numpy()), offset + start, entry.file)
            flat[start : start + size].copy_(buffer, non_blocking=True)
            staging.copied[turn] = torch.cuda.Event()
            staging.copied[turn].record(stream)


def _read_exactly(descriptor: int, into: memoryview, offset: int, file: str) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(descriptor, [into[done:]], offset + done)
        if got == 0:
            raise DamagedFile(file, f"it ends {len(into) - done} bytes before a tensor's end")
        done += got
