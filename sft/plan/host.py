"""The host side of a plan: what fsdp.cpu_offload (sharded state in pinned host memory) and ac.offload
(the checkpointed blocks' inputs) hold in each node's memory, and the one line that refuses a plan
whose node cannot hold it."""

from __future__ import annotations

import math

from sft.config import STATE_BYTES, Config
from sft.parallel.activation_checkpointing import ac_block_indices
from sft.parallel.mesh import ParallelDims
from sft.plan.memory import GIB, Machine, Shapes, gpus_text, tokens_per_gpu

# One rank's own host footprint (CUDA context, libraries, Python): 1.8 GiB RSS per rank measured
# after loading 14B without offload (docs/BENCHMARKS.md); an assumption the offload bench checks.
HOST_PROCESS_GIB = 2.0


def pinned_bytes(size: int) -> int:
    """What a pinned host buffer of `size` bytes takes: PyTorch's caching pinned allocator rounds every
    block up to a power of two."""
    return 1 << (size - 1).bit_length()


def host_bytes_per_rank(s: Shapes, shard_ranks: int, staged_checkpoints: bool = False) -> float:
    """Host bytes one rank holds with fsdp.cpu_offload (docs/training.md, "The memory model")."""
    # FSDP2 shards dim 0, padded to a multiple of the shard ranks.
    shards = [math.ceil(shape[0] / shard_ranks) * math.prod(shape[1:]) for shape in s.param_shapes]
    # FSDP pins each parameter's shard, and each gradient's copy to the host lands in a pinned block
    pinned = 2 * sum(pinned_bytes(4 * n) for n in shards)
    staged = STATE_BYTES.checkpoint * sum(shards) if staged_checkpoints else 0  # the state the writer writes
    return pinned + STATE_BYTES.optimizer * sum(shards) + staged + HOST_PROCESS_GIB * GIB


def offloaded_block_bytes_per_rank(s: Shapes, cfg: Config, m: Machine, micro_batch: int | None = None,
                                   ac_ratio: float | None = None) -> int:
    """ac.offload: the checkpointed blocks' inputs (bf16) of one micro-batch in pinned host memory, at
    `micro_batch` and `ac_ratio` (default: the config's)."""
    if not cfg.ac.offload:
        return 0
    micro_batch = cfg.train.micro_batch_size if micro_batch is None else micro_batch
    blocks = len(ac_block_indices(s.layers, cfg.ac.ratio if ac_ratio is None else ac_ratio))
    return blocks * pinned_bytes(2 * tokens_per_gpu(cfg, m.gpus, micro_batch) * s.hidden)


def host_gib_per_node(s: Shapes, cfg: Config, m: Machine, micro_batch: int | None = None,
                      ac_ratio: float | None = None) -> float:
    """Predicted host GiB per node: with fsdp.cpu_offload its ranks' shards (pinned rounding), with
    ac.offload the blocks' inputs (offloaded_block_bytes_per_rank), and the processes."""
    if cfg.fsdp.cpu_offload:
        per_rank = host_bytes_per_rank(s, ParallelDims.of(cfg, m.gpus).shard_ranks,
                                       cfg.checkpoint.stages_in_host_memory)
    else:
        per_rank = HOST_PROCESS_GIB * GIB
    return m.gpus_on_a_node * (per_rank + offloaded_block_bytes_per_rank(s, cfg, m, micro_batch, ac_ratio)) / GIB


def host_problem(s: Shapes, cfg: Config, m: Machine, micro_batch: int | None = None,
                 ac_ratio: float | None = None) -> str | None:
    """Why the host side of fsdp.cpu_offload and ac.offload does not fit the node (at `micro_batch` and
    `ac_ratio`, default the config's), or None (also without either)."""
    offloads = [key for key, on in (("fsdp.cpu_offload", cfg.fsdp.cpu_offload), ("ac.offload", cfg.ac.offload)) if on]
    if not offloads:
        return None
    need = host_gib_per_node(s, cfg, m, micro_batch, ac_ratio)
    if need <= m.host_mem_gib:
        return None
    # what lowers each: more shard ranks (fsdp.cpu_offload's shards), a smaller share of a row (ac.offload)
    fixes = ["fewer GPUs per node"] if m.gpus_on_a_node > 1 else []
    if cfg.fsdp.cpu_offload:
        fixes.insert(0, "more nodes (more shard ranks)")
        fixes += ["checkpoint.async_save=false"] if cfg.checkpoint.stages_in_host_memory else []
    if cfg.ac.offload:
        fixes += ["a smaller train.micro_batch_size or ac.ratio", "a larger cp.degree"]
    fixes.append(" / ".join(f"{key}=false" for key in offloads))
    setting = "" if micro_batch is None and ac_ratio is None else \
        f" at train.micro_batch_size={micro_batch or cfg.train.micro_batch_size} " \
        f"ac.ratio={cfg.ac.ratio if ac_ratio is None else ac_ratio:g}"
    digits = 0 if round(need) > round(m.host_mem_gib) else 1  # never "needs 114 GiB > 114 GiB"
    return (f"{' with '.join(offloads)} needs {need:.{digits}f} GiB of host memory per node "
            f"({gpus_text(m.gpus_on_a_node)} per node{setting}) > {m.host_mem_gib:.{digits}f} GiB: use "
            f"{', '.join(fixes[:-1])} or {fixes[-1]}")
