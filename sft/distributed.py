"""Process-group setup and rank-aware helpers. One code path for 1 and N ranks.

`python train.py` without torchrun runs as a world of size 1, so FSDP2 and every collective
behave exactly as under torchrun; there is no separate single-process branch to keep correct.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from sft.config import UserError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_backend(device_type: str, cpu_offload: bool) -> str:
    """NCCL on GPUs, gloo on CPU; with CPU offload also gloo for the host tensors on GPUs.

    With fsdp.cpu_offload the gradients are host DTensors, so the grad-norm all-reduce runs on CPU
    tensors and needs a CPU backend ("No backend type associated with device type cpu" otherwise).
    Gloo is added only then: it costs a full TCP mesh between all ranks at start-up, and with a CPU
    backend in the group, object collectives (broadcast_object_list, gather_object) move to gloo.
    """
    if device_type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


def init_distributed(cpu_offload: bool = False) -> DistEnv:
    """Join the torchrun world (or create a world of one); see process_group_backend."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    expected = os.environ.get("SFT_EXPECTED_WORLD_SIZE")  # set by slurm/train.slurm: nodes x GPUs
    if expected and int(expected) != world_size:
        raise RuntimeError(f"torchrun formed a world of {world_size} ranks, expected {expected} (nodes x GPUs): "
                           "the nodes did not all join one rendezvous")
    if torch.cuda.is_available():
        # Fewer fragmentation OOMs with variable-length batches (must be set before CUDA starts).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(process_group_backend(device.type, cpu_offload),
                            device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, local_rank, world_size, device)


def log0(*parts: object) -> None:
    """Print on rank 0 only, with a timestamp, flushed (Slurm logs are files)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(time.strftime("[%H:%M:%S]"), *parts, flush=True)


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a small vector of numbers over all ranks (float64, so token counts stay exact)."""
    t = torch.as_tensor(values, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


T = TypeVar("T")


def decided_on_rank0(decide: Callable[[], T]) -> T:
    """Collective: run `decide` on rank 0 only and hand its result, or its UserError, to every
    rank. One rank reads the shared filesystem instead of all of them, all ranks agree, and an
    error stops every rank at the same point (none is left waiting in a later collective)."""
    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", decide())
        except UserError as e:
            outcome[0] = ("error", e)
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        value.shared = True  # raised alike on every rank: reported once, by rank 0
        raise value
    return value
