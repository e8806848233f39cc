"""Process-group setup and rank-aware helpers. One code path for 1 and N ranks.

`python train.py` without torchrun runs as a world of size 1, so FSDP2 and every collective
behave exactly as under torchrun; there is no separate single-process branch to keep correct.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor

from sft.errors import UserError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def process_group_backend(device_type: str, cpu_offload: bool) -> str:
    """NCCL on GPUs, gloo on CPU; with CPU offload also gloo for the host tensors on GPUs.

    With fsdp.cpu_offload the gradients are host DTensors, so the grad-norm all-reduce runs on CPU
    tensors and needs a CPU backend ("No backend type associated with device type cpu" otherwise).
    The default group gets gloo only then: with a CPU backend in it, object collectives
    (broadcast_object_list, gather_object) move to gloo. (Separate gloo groups serve the long waits
    for rank 0 and the background checkpoint writes.)
    """
    if device_type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


# How long ranks may wait for one rank's long single-rank work (first-run tokenisation of a big
# dataset): far beyond any collective timeout, which is meant to catch hung or dead ranks.
LONG_WAIT = timedelta(hours=12)
_long_wait_group: dist.ProcessGroup | None = None


def init_distributed(cpu_offload: bool = False, timeout_minutes: float | None = None) -> DistEnv:
    """Join the torchrun world (or create a world of one); see process_group_backend.

    `timeout_minutes` bounds every collective (dist.timeout_minutes): a rank that died or hangs
    stops the others after that long. Waiting for one rank's long work uses a separate gloo group
    with LONG_WAIT instead (decided_on_rank0(..., long_wait=True)).
    """
    # Without torchrun: a world of one, on an in-process store (no port to pick, none to collide).
    alone = "RANK" not in os.environ
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
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
    timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _reach_launcher_store()
    dist.init_process_group(process_group_backend(device.type, cpu_offload), timeout=timeout,
                            device_id=device if device.type == "cuda" else None,
                            **({"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}))
    global _long_wait_group
    _long_wait_group = dist.new_group(backend="gloo", timeout=LONG_WAIT)
    return DistEnv(rank, local_rank, world_size, device)


def shut_down() -> None:
    """Collective, at a run's end: once every rank is done with them (a barrier: no rank tears down
    gloo/NCCL while another still talks to it), the process groups are destroyed and no reference to
    one is kept. The process then ends without the interpreter's teardown (sft.errors.run_command),
    where C++ destructors could abort a finished run ('terminate called without an active exception')."""
    global _long_wait_group
    dist.barrier()
    dist.destroy_process_group()
    _long_wait_group = None


# torchrun's store is up before it starts its workers: a worker that cannot reach it in this long
# will not (its torchrun died in the worker's first moments), where the rendezvous itself would
# retry for the whole collective timeout, twice.
LAUNCHER_STORE_TIMEOUT = timedelta(seconds=20)


def _reach_launcher_store() -> None:
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=LAUNCHER_STORE_TIMEOUT)
    except (RuntimeError, dist.DistError) as e:  # DistNetworkError and friends
        raise UserError(f"cannot reach the store of the torchrun that started this worker at {address} within "
                        f"{LAUNCHER_STORE_TIMEOUT.seconds} s ({type(e).__name__}): its torchrun is gone, or the "
                        "network between the nodes is down; nothing was trained, relaunch the same command") from None


def log0(*parts: object) -> None:
    """Print on rank 0 only, with a timestamp, flushed (Slurm logs are files)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(time.strftime("[%H:%M:%S]"), *parts, flush=True)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_slice(tensor: torch.Tensor) -> tuple[tuple[slice, ...], torch.Tensor]:
    """(where this rank's part of `tensor` sits in the whole tensor, that part)."""
    if isinstance(tensor, DTensor):
        # The public chunk description DCP itself uses: where this rank's shard sits.
        chunk = tensor.__create_chunk_list__()[0]
        shape, offset, local = chunk.sizes, chunk.offsets, tensor.to_local()
    else:
        shape, offset, local = tensor.shape, (0,) * tensor.dim(), tensor
    return tuple(slice(o, o + s) for o, s in zip(offset, shape)), local


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without making the host wait for the GPU: a plain copy from host memory
    to a GPU waits until the GPU has run everything queued before it (a whole step), a copy from
    pinned memory is queued like a kernel. A `tensor` already pinned is copied from as it is: do not
    change it afterwards (the copy may not have run yet)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class _GradientContiguous(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: an all-gather's backward is a
    reduce-scatter, which NCCL takes only contiguous (gloo takes any), and the gradient of a gathered
    tensor that is then permuted (`movedim`) arrives permuted."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


# Autograd-aware all-gather (backward: reduce-scatter), traceable by compile; renamed in torch 2.13.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def gather_along(tensor: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Every rank's `tensor` of the group, concatenated in rank order along `dim`; differentiable
    (each rank gets back the gradient of its own part) and traceable by torch.compile."""
    local = tensor.movedim(dim, 0).contiguous()  # gathered along dim 0: no extra copy on any torch version
    return _GradientContiguous.apply(_all_gather_autograd(local, 0, group_name)).movedim(0, dim)


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a small vector of numbers over all ranks (float64, so token counts stay exact); the host
    does not wait for the result."""
    t = to_device(torch.as_tensor(values, dtype=torch.float64), device).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def smallest_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each of a few numbers' smallest value over all ranks (waits for the result)."""
    t = to_device(torch.as_tensor(values, dtype=torch.float64), device).clone()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


T = TypeVar("T")


def rank0_first(work: Callable[[], T]) -> T:
    """Collective: rank 0 runs `work` before the other ranks do, so that bad input (a missing model,
    malformed data) stops every rank with one error, reported once, and the others then read what
    rank 0 left in the caches (the datasets cache, the hub cache). They wait without the collective
    timeout: a first run on a large dataset can tokenise for longer than dist.timeout_minutes. A
    rank that then fails alone (a node-local file) stops every rank too, and rank 0 reports it.
    Never call it inside `work` of another collective helper: the ranks would wait in different
    collectives."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    done: list[T] = []
    decided_on_rank0(lambda: done.append(work()), long_wait=True)
    failure: BaseException | None = None
    if not done:
        try:
            done.append(work())
        except BaseException as e:  # every rank must reach the gather below
            failure = e
    said = None if failure is None else str(failure) if isinstance(failure, UserError) else (
        f"{type(failure).__name__}: {failure}")
    failures: list = [None] * dist.get_world_size()
    dist.all_gather_object(failures, said, group=_long_wait_group)
    if failure is not None and not isinstance(failure, UserError):
        raise failure  # this rank keeps its own traceback
    rank, said = next(((r, f) for r, f in enumerate(failures) if f), (None, None))
    if said is not None:
        error = UserError(f"rank {rank}: {said}")
        error.shared = dist.get_rank() != 0  # rank 0 says it, once
        raise error
    return done[0]


def decided_on_rank0(decide: Callable[[], T], long_wait: bool = False) -> T:
    """Collective: run `decide` on rank 0 only and hand its result, or its error, to every rank.

    One rank reads the shared filesystem instead of all of them, all ranks agree, and an error
    stops every rank at the same point (none is left waiting in a later collective): a UserError
    is raised alike everywhere, any other exception as a RuntimeError naming it. With
    `long_wait` the others wait on a gloo group without the collective timeout (LONG_WAIT), for
    work that can take longer than dist.timeout_minutes (tokenising a large dataset).
    """
    outcome: list = [None]
    crash: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", decide())
        except UserError as e:
            outcome[0] = ("error", e)
        except BaseException as e:
            outcome[0], crash = ("crash", f"{type(e).__name__}: {e}"), e
    dist.broadcast_object_list(outcome, src=0, group=_long_wait_group if long_wait else None)
    if crash is not None:
        raise crash  # rank 0 keeps its own traceback
    kind, value = outcome[0]
    if kind == "error":
        value.shared = True  # raised alike on every rank: reported once, by rank 0
        raise value
    if kind == "crash":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value
