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
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool, "C64": torch.complex64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
          "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# Bytes a thread stages in pinned host memory per copy to a GPU (two buffers a thread, taking turns).
STAGING_BYTES = 32 * 2**20


class DamagedFile(Exception):
    """A file that is not safetensors or is shorter than its header says (the message says how)."""

    def __init__(self, file: str, reason: str):
        super().__init__(reason)
        self.file = file


class UnsupportedDtype(DamagedFile):
    """A tensor stored in a dtype this torch has no type for."""


@dataclass(frozen=True)
class Entry:
    file: str
    dtype_name: str  # as the header names it (F32, BF16, ...)
    shape: tuple[int, ...]
    begin: int  # the tensor's first byte in its file
    end: int


def read_header(path: Path) -> tuple[dict, int, int]:
    """(the header's entries, the offset of the data, the file's size) of the safetensors file at `path`."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"its first 8 bytes give a header of {length} bytes")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, struct.error) as e:
        raise DamagedFile(path.name, f"{type(e).__name__}: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + length, size


class SafetensorsFiles:
    """The tensors of a checkpoint's safetensors `files` (names relative to `root`), by name."""

    def __init__(self, root: Path, files: list[str]):
        self.root = root
        self.entries: dict[str, Entry] = {}
        for file in files:
            header, data, size = read_header(root / file)
            for name, info in header.items():
                try:
                    begin, end = (data + offset for offset in info["data_offsets"])
                    entry = Entry(file, info["dtype"], tuple(info["shape"]), begin, end)
                except (KeyError, TypeError, ValueError) as e:
                    raise DamagedFile(file, f"its header's entry {name!r} is unreadable ({type(e).__name__}: "
                                            f"{e})") from None
                if entry.dtype_name not in DTYPES:  # a dtype this torch has no type for: refused if read
                    self.entries[name] = entry
                    continue
                nbytes = math.prod(entry.shape) * DTYPES[entry.dtype_name].itemsize
                if not data <= begin <= end <= size or end - begin != nbytes:
                    raise DamagedFile(file, f"{name!r} lies outside the file's {size} bytes or has the wrong "
                                            "size (a truncated download?)")
                self.entries[name] = entry
        self._descriptors: dict[str, int] | None = None  # the files `reading` keeps open
        self._lock = threading.Lock()
        self._reads = PositionalReads()

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
        """Slice `index` (a tuple of slices, or `...`) of tensor `name`, on `device`: where the first
        item is a plain slice, only the rows of the first dimension it takes are read."""
        entry = self.entries[name]
        if entry.dtype_name not in DTYPES:
            raise UnsupportedDtype(entry.file, f"{name!r} is stored as {entry.dtype_name}, which this torch cannot "
                                               "read")
        dtype = DTYPES[entry.dtype_name]
        index = () if index is Ellipsis else tuple(index)
        first = index[0] if index else slice(None)
        rows = entry.shape and isinstance(first, slice) and first.step in (None, 1)
        begin, end = first.indices(entry.shape[0])[:2] if rows else (0, entry.shape[0] if entry.shape else 0)
        end = max(begin, end)
        row_bytes = math.prod(entry.shape[1:]) * dtype.itemsize
        tensor = torch.empty((end - begin, *entry.shape[1:]) if entry.shape else (), dtype=dtype, device=device)
        with self._descriptor(entry.file) as descriptor:
            self._reads.into(descriptor, entry.begin + begin * row_bytes, tensor, entry.file)
        if rows:  # the rows read; the rest of the index on them
            return tensor[(slice(None), *index[1:])] if index[1:] else tensor
        return tensor[index] if index else tensor

    def read_bytes(self, name: str, offset: int, size: int) -> bytes:
        """`size` bytes of tensor `name`'s file from `offset` (absolute, within the tensor)."""
        into = bytearray(size)
        with self._descriptor(self.entries[name].file) as descriptor:
            _read_exactly(descriptor, memoryview(into), offset, self.entries[name].file)
        return bytes(into)


class PositionalReads:
    """Bytes of an open file into a tensor with positional reads: on the CPU straight into it, onto a
    GPU through the calling thread's pinned staging buffers (several threads read at once)."""

    def __init__(self):
        self._staging = threading.local()  # each thread's pinned buffers

    def into(self, descriptor: int, offset: int, tensor: torch.Tensor, file: str) -> None:
        """The file's bytes from `offset` into the contiguous `tensor` (`file` names it in errors)."""
        flat = tensor.reshape(-1).view(torch.uint8)
        if tensor.device.type == "cpu":
            _read_exactly(descriptor, memoryview(flat.numpy()), offset, file)
            return
        if not hasattr(self._staging, "pinned"):  # this thread's
            self._staging.pinned = _PinnedStaging(tensor.device)
        self._staging.pinned.copy(descriptor, offset, flat, file)


class _PinnedStaging:
    """A thread's two pinned buffers, taking turns: a chunk is read into one while the other's copy to
    the GPU runs."""

    def __init__(self, device: torch.device):
        with torch.cuda.device(device):  # pinned in this rank's GPU's context (a thread starts in GPU 0's)
            self.buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, descriptor: int, offset: int, into: torch.Tensor, file: str) -> None:
        """The file's bytes from `offset` into the GPU tensor `into` (flat, bytes), chunk by chunk."""
        stream = torch.cuda.current_stream(into.device)
        for start in range(0, into.numel(), STAGING_BYTES):
            size, turn = min(STAGING_BYTES, into.numel() - start), self.turn
            self.turn ^= 1
            if self.copied[turn] is not None:
                self.copied[turn].synchronize()  # this buffer's previous copy has left it
            buffer = self.buffers[turn][:size]
            _read_exactly(descriptor, memoryview(buffer.numpy()), offset + start, file)
            into[start : start + size].copy_(buffer, non_blocking=True)
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record(stream)


def _read_exactly(descriptor: int, into: memoryview, offset: int, file: str) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(descriptor, [into[done:]], offset + done)
        if got == 0:
            raise DamagedFile(file, f"it ends {len(into) - done} bytes before a tensor's end")
        done += got
