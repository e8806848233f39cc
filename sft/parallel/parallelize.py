"""Parallelise a meta-device model, in the fixed order: context parallelism -> expert parallelism ->
float8 -> tiled MLPs -> activation checkpointing -> compile -> host offload of what checkpointing keeps -> FSDP2.

The order matters: context parallelism only swaps the attention function, and expert parallelism
places the experts on their ranks and swaps how rows reach them, before anything wraps or compiles
the blocks (FSDP then shards the placed experts over the ranks orthogonal to ep); float8 swaps the
blocks' Linear modules, so it goes first, before anything
wraps the blocks (AC), traces them (compile) or takes over their parameters (FSDP; tensorwise float8
weights then all-gather in float8). The checkpoint wrapper must be inside the compiled region so
compile sees (and can optimise) the recomputation, and `fully_shard` goes last so its hooks wrap
the compiled block from outside (TorchTitan's order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from sft.config import ACConfig, FSDPConfig
from sft.distributed import log0
from sft.parallel.activation_checkpointing import ac_block_indices, apply_ac, apply_host_offload
from sft.parallel.context_parallel import apply_context_parallel
from sft.parallel.expert_parallel import apply_expert_parallel
from sft.parallel.float8 import apply_float8
from sft.parallel.fsdp import apply_fsdp
from sft.parallel.mesh import ParallelDims
from sft.parallel.tiled_mlp import apply_mlp_tiling

if TYPE_CHECKING:
    from sft.adapters.lora import LoRA
    from sft.models.moe import MoE


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block in place (no `_orig_mod.` in names). Blocks are identical, so one
    compiled graph serves them all; lengths are bucketed by the collate to limit recompiles."""
    for block in blocks:
        block.compile()
    log0(f"applied torch.compile to {len(blocks)} blocks")


def parallelize(model: nn.Module, blocks: list[nn.Module], dims: ParallelDims, ac: ACConfig, compile_blocks: bool,
                fsdp: FSDPConfig, float8: str = "none", moe: MoE | None = None, lora: LoRA | None = None,
                root: nn.Module | None = None) -> None:
    """context parallelism -> expert parallelism -> float8 -> tiled MLPs -> AC -> compile -> offload -> FSDP
    on a meta-device model, over the mesh of `dims` (see the module docstring for why this order). `float8` is
    precision.float8; `moe` the handle apply_moe returned (its routing is kept under checkpointing,
    its experts placed by expert parallelism and sharded by its placement); `lora` the handle
    apply_lora returned (float8 then runs only the frozen base matmuls; FSDP leaves NF4 weights whole, and
    on one GPU the whole frozen base);
    `root` the module FSDP's root unit wraps (the loss that holds the model's children; the model itself by
    default)."""
    if dims.cp_enabled:  # swaps the attention function only; nothing wraps anything yet
        apply_context_parallel(model, dims, moe, checkpointed_compiled=compile_blocks and ac.ratio > 0)
    if dims.ep_enabled:  # apply_moe refused moe.ep_degree > 1 for a dense model
        checkpointed = {m for i in ac_block_indices(len(blocks), ac.ratio) for m in blocks[i].modules()}
        apply_expert_parallel(moe, dims, checkpointed)
    if float8 != "none":
        apply_float8(blocks, float8, emulate=dims.fsdp_mesh.device_type == "cpu", compiled=compile_blocks, lora=lora)
    if ac.mlp_tile_tokens:  # inside the checkpointed region: the recomputation tiles too
        apply_mlp_tiling(blocks, ac.mlp_tile_tokens)
    blocks = apply_ac(model, blocks, ac, always_kept=moe.kept_ops if moe else frozenset(),
                      adapter_widths=lora.widths if lora else frozenset())
    if compile_blocks:
        apply_compile(blocks)
    if ac.offload:  # outside the compiled region: its hooks see what the compiled block keeps
        blocks = apply_host_offload(model, blocks)
    apply_fsdp(model if root is None else root, blocks, dims, fsdp, moe, lora)
