"""FSDP2: each decoder block its own unit, then the root; gradients summed over ranks (the loss is
already divided by the global token count), from the compute stream's memory pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from sft.config import DTYPES, FSDPConfig
from sft.distributed import log0
from sft.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from sft.adapters.lora import LoRA
    from sft.models.moe import MoE


# torch 2.13 renamed reduce_scatter_tensor (which now warns) to reduce_scatter_single; 2.11 has only the former.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GradientsInComputePool:
    """FSDP2's reduce-scatter (a custom comm for `set_custom_reduce_scatter`) whose output, the
    buffer the sharded gradients are views of, comes from the compute stream's memory pool.

    Why: FSDP2 allocates that output on its reduce-scatter stream, and the caching allocator keeps
    each stream's freed memory for that stream. After each step the gradients (4 bytes per
    parameter per shard: 14 GiB for 7B on 2 GPUs) are freed into the reduce-scatter stream's pool,
    where the next forward's activations cannot use them, nor can the next gradients use the
    activations' memory: near the memory limit a step then made the allocator release its cache
    and synchronise twice (issue #24: 12-16 retries per 8 steps, 2-6% slower). In the compute pool
    the two take turns in the same memory. `record_stream` keeps the block from being reused
    before the reduce-scatter stream's work on it is done.

    The compute stream is the default stream, where train.py runs forward and backward; FSDP2 asks
    for the reduce-scatter's input there and for its output on its own stream. Only for plain FSDP:
    under HSDP another stream (the all-reduce) also works on the output. Not for the gradients of
    fsdp.reduce_dtype=bfloat16 either: FSDP2 casts the reduced bf16 buffer to float32 on its own
    stream, outside this comm (measured: the retries come back)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if stream is None or stream == torch.cuda.default_stream(device):  # the reduce-scatter's input
            return torch.empty(*size, dtype=dtype, device=device)
        with torch.cuda.stream(torch.cuda.default_stream(device)):
            output = torch.empty(*size, dtype=dtype, device=device)
        output.record_stream(stream)
        return output

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def whole_frozen(module: nn.Module, shard_ranks: int, cfg: FSDPConfig) -> set[nn.Parameter]:
    """The frozen parameters of `module` FSDP leaves alone: where it shards them over one rank (one GPU,
    replicas only; each ep rank's own experts: `experts_outside_fsdp`) and keeps the shards on the
    GPU, a frozen parameter already in fsdp.param_dtype (LoRA's base) has nothing to shard, cast or
    reduce, and FSDP would only copy it into its all-gather buffer before each block's forward and
    backward: on one H200 the whole Qwen3-30B-A3B's LoRA step copied its 1.2 GB of experts a block
    twice, 54 ms of a 590 ms step (docs/BENCHMARKS.md)."""
    if shard_ranks > 1 or cfg.cpu_offload:
        return set()
    return {p for p in module.parameters() if not p.requires_grad and p.dtype == DTYPES[cfg.param_dtype]}


def experts_outside_fsdp(moe: MoE | None, dims: ParallelDims, cfg: FSDPConfig) -> set[nn.Parameter]:
    """The expert parameters FSDP leaves alone under expert parallelism over every rank of the run
    (moe.ep_degree = the world size): there each rank holds its experts whole and alone, so there is
    nothing to gather, and their gradients are whole where they accumulate (every row routed to an
    expert reached its rank through the all-to-all, and its gradient came back the same way). Where
    such a parameter is already in fsdp.param_dtype (bf16 master weights, LoRA's bf16 base and
    adapters) FSDP would only copy it into its all-gather buffer and its gradient out of its
    reduce-scatter buffer, a block's experts twice a pass: 16% of the whole Qwen3-30B-A3B's step
    (docs/BENCHMARKS.md). Float32 masters still go through FSDP, whose mixed precision casts them."""
    if moe is None or not dims.ep_enabled or dims.expert_fsdp_mesh.size() > 1 or cfg.cpu_offload:
        return set()
    return {p for block in moe.blocks for p in block.experts.parameters() if p.dtype == DTYPES[cfg.param_dtype]}


def apply_fsdp(root: nn.Module, blocks: list[nn.Module], dims: ParallelDims, cfg: FSDPConfig,
               moe: MoE | None = None, lora: LoRA | None = None) -> None:
    """Shard each block as its own FSDP unit, then the root (embeddings, final norm, lm_head: `root`
    is the model, or the loss that holds its children, sft/training/loss.py:SFTLoss), over
    the mesh's shard ranks (and replicas). MoE experts are split by the handle's placement
    (sft/models/moe.py), dim 0 for the rest; under expert parallelism each block's experts are a unit
    of their own, sharded over the ranks orthogonal to ep (sft/parallel/expert_parallel.py), or, where
    ep spans every rank, left whole to their ranks (`experts_outside_fsdp`). QLoRA's
    NF4 weights stay whole on every rank (LoRA.nf4_parameters), and on one GPU every frozen weight
    already in the compute dtype (`whole_frozen`).

    Tied input/output embeddings are one parameter and both live in the root unit. The gradient
    divide factor is 1 on every unit: the loss is already divided by the global count of
    supervised tokens (sft/training/loss.py), so FSDP must sum, not average, over ranks.
    """
    outside = experts_outside_fsdp(moe, dims, cfg)
    ignored = (lora.nf4_parameters() if lora else set()) | whole_frozen(root, dims.shard_ranks, cfg) | outside
    options = dict(mesh=dims.fsdp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype],
                                                                       reduce_dtype=DTYPES[cfg.reduce_dtype]),
                   offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(), ignored_params=ignored)
    for i, block in enumerate(blocks):
        if dims.ep_enabled and moe is not None:  # first: the block's unit then leaves them to this one
            for sparse in (m for m in block.modules() if m in moe.blocks):
                if not set(sparse.experts.parameters()) - outside:
                    continue
                fully_shard(sparse.experts, reshard_after_forward=cfg.reshard_after_forward and i < len(blocks) - 1,
                            **{**options, "mesh": dims.expert_fsdp_mesh, "shard_placement_fn":
                               moe.shard_placement(dims.expert_fsdp_mesh.size(), dims.ep)})
        # The last block's parameters are needed again first thing in backward: keep them.
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward and i < len(blocks) - 1,
                    shard_placement_fn=moe.shard_placement(dims.shard_ranks) if moe else None, **options)
    # None lets FSDP keep the root unsharded between forward and backward (an explicit True
    # would free and re-gather the embeddings and lm_head every step).
    fully_shard(root, reshard_after_forward=None if cfg.reshard_after_forward else False, **options)
    reduce_scatter = None if dims.replicated else GradientsInComputePool()  # stateless: one for all units
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM instead of NCCL's PREMUL_SUM(1): the same result, and gloo supports it.
            module.set_force_sum_reduction_for_comms(True)
            if reduce_scatter is not None:
                module.set_custom_reduce_scatter(reduce_scatter)
    log0(f"applied FSDP2 to {len(blocks)} blocks + root on mesh {tuple(dims.fsdp_mesh.shape)}, "
         f"params {cfg.param_dtype}, reduce {cfg.reduce_dtype}"
         + ("; the experts whole on their ep ranks, outside FSDP" if outside else ""))
