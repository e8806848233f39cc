"""Activation checkpointing: which decoder blocks keep only part of their activations for backward
(ac.ratio), and what a checkpointed block keeps (ac.mode): its input only (whole blocks recomputed),
or the outputs of its expensive ops (op-level, selective checkpointing)."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from sft.config import ACConfig
from sft.distributed import log0
from sft.models.moe import ROUTING_OPS, router_loss


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
