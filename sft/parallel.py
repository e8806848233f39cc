"""Parallelise a meta-device model, in the fixed order: float8 -> activation checkpointing -> compile
-> FSDP2.

The order matters: float8 swaps the blocks' Linear modules, so it goes first, before anything
wraps the blocks (AC), traces them (compile) or takes over their parameters (FSDP; tensorwise float8
weights then all-gather in float8). The checkpoint wrapper must be inside the compiled region so
compile sees (and can optimise) the recomputation, and `fully_shard` goes last so its hooks wrap
the compiled block from outside (TorchTitan's order).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from sft.config import DTYPES, ACConfig, ConfigError, FSDPConfig
from sft.context_parallel import ContextParallel, apply_context_parallel
from sft.distributed import log0
from sft.float8 import apply_float8
from sft.moe import ROUTING_OPS, expert_placement, router_loss

def ac_block_indices(num_blocks: int, ratio: float) -> list[int]:
    """0-based indices of the blocks to checkpoint for `ratio`, spread evenly over depth.

    Block i (1-based) is picked when i * ratio reaches the next threshold 0.5, 1.5, 2.5, ...
    (IBM fms-fsdp's rule), so about round(num_blocks * ratio) blocks are picked, evenly spaced.
    For 8 blocks: 0 -> [], 0.25 -> [1, 5], 0.5 -> [0, 2, 4, 6], 0.75 -> [0, 1, 3, 4, 5, 7], 1 -> all.
    """
    picked, threshold = [], 0.5
    for i in range(1, num_blocks + 1):
        if ratio > 0 and i * ratio >= threshold:
            picked.append(i - 1)
            threshold += 1
    return picked


def _replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
    raise AssertionError("block not found in model")


@functools.cache  # built on first use, then asked for every op of every checkpointed forward
def _expensive_ops() -> tuple[frozenset, frozenset]:
    """(matmuls, other ops whose outputs op-level checkpointing keeps). Matmuls and attention are
    the work that dominates a block (at 4k tokens the matmuls are ~90% of a 7B block's FLOPs; at 32k
    attention is a third); everything else (norms, rotary, SiLU, residual sums, casts) is
    memory-bound and cheap to redo. No collective runs inside a block (FSDP's all-gather and
    reduce-scatter are hooks around it), so none is listed (TorchTitan keeps tensor parallelism's)."""
    aten = torch.ops.aten
    matmuls = frozenset((aten.mm.default, aten.addmm.default, aten.bmm.default,
                         aten._scaled_mm.default,  # float8 matmuls (precision.float8)
                         aten._grouped_mm.default))  # MoE experts (sft/moe.py)
    others = frozenset((
        # float8's amax of a tensor: a scalar, so keeping it is free and spares a full read of the
        # tensor to recompute the scale of its float8 cast.
        aten.max.default,
        # Attention: output and log-sum-exp (what its backward reads) per SDPA backend, and flex
        # attention (packing); the CPU kernel so that CPU tests exercise this path.
        aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch._higher_order_ops.flex_attention,
        # MoE routing: recomputation must reuse the forward's choice of experts (sft/moe.py).
        *ROUTING_OPS,
    ))
    return matmuls, others


# ac.mode -> keep every n-th matmul output. ops keeps them all: almost nothing but the cheap ops is
# recomputed, at ~70% of an unchecked block's activations (Qwen2.5-7B shapes). ops_half keeps the
# 1st, 3rd, ... (TorchTitan's default): in a Llama/Qwen block (q, k, v, o, gate, up, down) that is
# q, v, gate and down, and recomputes k, o and up, ~35% of the block's matmul FLOPs, at ~40% of the
# activations; it is the op-level setting that fits where memory is tight (sft/plan.py sizes both).
# attention keeps no matmul (0): only attention's output, which at 32k tokens is a third of a block's
# forward FLOPs, for one bf16 vector per token.
OPS_KEEP_EVERY = {"ops": 1, "ops_half": 2, "attention": 0}


def _op_level_context(every: int) -> tuple:
    """Fresh selective-checkpoint contexts for one checkpointed forward (checkpoint asks for them on
    each call): the policy counts the matmuls of the forward and of its recomputation apart, so both
    make the same choices."""
    matmuls, others = _expensive_ops()
    seen = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in matmuls:
            seen[ctx.is_recompute] += 1
            keep = every > 0 and (seen[ctx.is_recompute] - 1) % every == 0
        else:
            keep = func in others
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _routing_kept_context() -> tuple:
    """Whole-block checkpointing of an MoE block: everything is recomputed but the routing decision."""
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func in ROUTING_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: nn.Module, blocks: list[nn.Module], ac: ACConfig) -> list[nn.Module]:
    """Wrap the blocks ac.ratio picks in non-reentrant activation checkpointing (ac.mode: the whole
    block recomputed, or only its cheap ops); returns the new block list."""
    chosen = set(ac_block_indices(len(blocks), ac.ratio))
    # Op-level: the selective-checkpoint contexts tell autograd (or, compiled, the partitioner) which
    # op outputs to keep.
    options = {}
    if ac.mode in OPS_KEEP_EVERY:
        options["context_fn"] = functools.partial(_op_level_context, OPS_KEEP_EVERY[ac.mode])
    elif router_loss(model):
        options["context_fn"] = _routing_kept_context
    wrapped = []
    for i, block in enumerate(blocks):
        if i in chosen:
            new = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)
            _replace_module(model, block, new)
            block = new
        wrapped.append(block)
    log0(f"applied activation checkpointing ({ac.mode}) to {len(chosen)}/{len(blocks)} blocks: {sorted(chosen)}")
    return wrapped


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block in place (no `_orig_mod.` in names). Blocks are identical, so one
    compiled graph serves them all; lengths are bucketed by the collate to limit recompiles."""
    for block in blocks:
        block.compile()
    log0(f"applied torch.compile to {len(blocks)} blocks")


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


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, cfg: FSDPConfig) -> None:
    """Shard each block as its own FSDP unit, then the root (embeddings, final norm, lm_head).

    Tied input/output embeddings are one parameter and both live in the root unit. The gradient
    divide factor is 1 on every unit: the loss is already divided by the global count of
    supervised tokens (sft/loss.py), so FSDP must sum, not average, over ranks.
    """
    options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype],
                                                             reduce_dtype=DTYPES[cfg.reduce_dtype]),
                   offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy())
    if router_loss(model):  # MoE: expert weights sharded over experts, or rows
        options["shard_placement_fn"] = expert_placement(mesh.shape[-1])
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first thing in backward: keep them.
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward and i < len(blocks) - 1, **options)
    # None lets FSDP keep the root unsharded between forward and backward (an explicit True
    # would free and re-gather the embeddings and lm_head every step).
    fully_shard(model, reshard_after_forward=None if cfg.reshard_after_forward else False, **options)
    reduce_scatter = GradientsInComputePool() if cfg.replicate_degree == 1 else None  # stateless: one for all units
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM instead of NCCL's PREMUL_SUM(1): the same result, and gloo supports it.
            module.set_force_sum_reduction_for_comms(True)
            if reduce_scatter is not None:
                module.set_custom_reduce_scatter(reduce_scatter)
    log0(f"applied FSDP2 to {len(blocks)} blocks + root on mesh {tuple(mesh.shape)}, "
         f"params {cfg.param_dtype}, reduce {cfg.reduce_dtype}")


def build_mesh(device_type: str, world_size: int, replicate_degree: int) -> DeviceMesh:
    """1-D mesh for FSDP, or (replicate, shard) for HSDP."""
    if world_size % replicate_degree:
        raise ConfigError(f"fsdp.replicate_degree={replicate_degree} does not divide the {world_size} ranks")
    if replicate_degree == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate_degree, world_size // replicate_degree),
                            mesh_dim_names=("replicate", "shard"))


def parallelize(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, ac: ACConfig,
                compile_blocks: bool, fsdp: FSDPConfig, float8: str = "none", cp: ContextParallel | None = None) -> None:
    """context parallelism -> float8 -> AC -> compile -> FSDP on a meta-device model (see the module
    docstring for why this order). `float8` is precision.float8."""
    if cp is not None and cp.degree > 1:  # swaps the attention function only; nothing wraps anything yet
        apply_context_parallel(model, cp)
    if float8 != "none":
        apply_float8(blocks, float8, emulate=mesh.device_type == "cpu", compiled=compile_blocks)
    blocks = apply_ac(model, blocks, ac)
    if compile_blocks:
        apply_compile(blocks)
    apply_fsdp(model, blocks, mesh, fsdp)
