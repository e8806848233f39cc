"""Host staging for asynchronous saves: pinned host copies of the sharded training state, made
ahead of the first save and refilled in place by every save, so that training waits only for the
copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sft.distributed import local_part


class HostStaging:
    """Host copies of the sharded training state for asynchronous saves, refilled in place by every
    save. `allocate` makes and pins them ahead of the first save, beside training (only the pinning
    itself holds training up, once); a buffer it did not make (or whose tensor changed shape) is
    made by the save and pinned after its write.
    Pinned, the copies run asynchronously at full PCIe speed.

    Our own rather than DCP's stagers: torch 2.11's DefaultStager drops its buffers after every
    save (its second save then re-pins, and fails with `KeyError: <class 'type'>`), and
    BlockingAsyncStager cannot build its cache without CUDA, where the CPU tests run.
    """

    # Smaller buffers gain nothing from pinning, and may share a page with one already pinned.
    MIN_PINNED_BYTES = 1 << 20

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}  # path in the state dict -> its host copy
        self._to_pin: list[torch.Tensor] = []

    def allocate(self, state: Any, rank: int) -> None:
        """Make the host buffers for `state` (its values are not copied) and pin them. Only a head
        start: should it fail, the first save makes the buffers itself."""
        made: dict[str, torch.Tensor] = {}
        to_pin: list[torch.Tensor] = []

        def empty(path: str, tensor: torch.Tensor) -> torch.Tensor:
            made[path] = torch.empty_like(tensor, device="cpu")  # a DTensor keeps its sharding
            if local_part(tensor).is_cuda and _pinnable(local_part(made[path])):
                to_pin.append(local_part(made[path]))
            return made[path]

        try:
            _map_tensors(state, empty)
            if any(local_part(buffer).device.type != "cpu" for buffer in made.values()):
                raise RuntimeError("empty_like(..., device='cpu') did not give host memory")
            for host in to_pin:
                # Fault the new pages in here, beside training: cudaHostRegister would do it while
                # holding up the training loop's CUDA calls (P-7B on 2 x H100, 43 GiB per rank: one
                # step 0.9 -> 19-33 s; faulted in first, the registration costs one step ~3.4 s).
                host.zero_()
        except Exception as e:
            print(f"rank {rank}: checkpoint: staging buffers not made ahead ({type(e).__name__}: {e}); the "
                  "first asynchronous save makes them", flush=True)
            return
        self._to_pin = to_pin
        self.pin_new_buffers(rank)
        self._buffers = made

    def stage(self, state: Any) -> Any:
        """`state` with every tensor replaced by its host copy (DTensors keep their sharding). Copies
        into pinned buffers are asynchronous: synchronize before reading them."""
        previous, self._buffers = self._buffers, {}

        def refill(path: str, tensor: torch.Tensor) -> torch.Tensor:
            buffer = previous.get(path)
            if buffer is not None and _same_layout(buffer, tensor):
                local_part(buffer).copy_(local_part(tensor), non_blocking=True)
            else:  # not made ahead, or the state changed shape: a new buffer
                buffer = tensor.to("cpu", copy=True)
                if local_part(tensor).is_cuda and _pinnable(local_part(buffer)):
                    self._to_pin.append(local_part(buffer))
            self._buffers[path] = buffer
            return buffer

        return _map_tensors(state, refill)

    def pin_new_buffers(self, rank: int) -> None:
        """Page-lock the buffers made since the last call (not while a copy into them may run). A
        buffer that cannot be pinned (a locked-memory limit) stays pageable: slower copies, same result."""
        failed = sum(int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes,
                                                             1)) != 0  # 1: cudaHostRegisterPortable
                     for host in self._to_pin)
        if failed:
            print(f"rank {rank}: checkpoint: could not pin {failed} of {len(self._to_pin)} staging buffers (the "
                  "locked-memory limit, ulimit -l?); asynchronous saves copy them more slowly", flush=True)
        self._to_pin.clear()


def _map_tensors(state: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], path: str = "") -> Any:
    """`state` (dicts, lists, tuples) with every tensor t replaced by fn(its path, t)."""
    if isinstance(state, dict):
        return {key: _map_tensors(value, fn, f"{path}/{key}") for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_map_tensors(value, fn, f"{path}/{i}") for i, value in enumerate(state))
    return fn(path, state) if isinstance(state, torch.Tensor) else state  # lr, flags: this save's values


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor in `state`, found by the same walk as _map_tensors."""
    found: list[torch.Tensor] = []

    def collect(_: str, tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    _map_tensors(state, collect)
    return found


def _pinnable(host: torch.Tensor) -> bool:
    return host.nbytes >= HostStaging.MIN_PINNED_BYTES


def _same_layout(buffer: torch.Tensor, state: torch.Tensor) -> bool:
    return (type(buffer) is type(state) and buffer.shape == state.shape and buffer.dtype == state.dtype
            and getattr(buffer, "placements", None) == getattr(state, "placements", None))


