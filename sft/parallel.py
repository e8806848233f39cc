"""Parallelise a meta-device model, in the fixed order: float8 -> activation checkpointing -> compile
-> FSDP2.

The order matters: float8 swaps the blocks' Linear modules, so it goes first, before anything
wraps the blocks (AC), traces them (compile) or takes over their parameters (FSDP; tensorwise float8
weights then all-gather in float8). The checkpoint wrapper must be inside the compiled region so
compile sees (and can optimise) the recomputation, and `fully_shard` goes last so its hooks wrap
the compiled block from outside (TorchTitan's order).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from sft.config import DTYPES, ConfigError, FSDPConfig
from sft.distributed import log0
from sft.float8 import apply_float8

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


def apply_ac(model: nn.Module, blocks: list[nn.Module], ratio: float) -> list[nn.Module]:
    """Wrap the chosen blocks in non-reentrant activation checkpointing; returns the new block list."""
    chosen = set(ac_block_indices(len(blocks), ratio))
    wrapped = []
    for i, block in enumerate(blocks):
        if i in chosen:
            new = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            _replace_module(model, block, new)
            block = new
        wrapped.append(block)
    log0(f"applied activation checkpointing to {len(chosen)}/{len(blocks)} blocks: {sorted(chosen)}")
    return wrapped


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block in place (no `_orig_mod.` in names). Blocks are identical, so one
    compiled graph serves them all; lengths are bucketed by the collate to limit recompiles."""
    for block in blocks:
        block.compile()
    log0(f"applied torch.compile to {len(blocks)} blocks")


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, cfg: FSDPConfig) -> None:
    """Shard each block as its own FSDP unit, then the root (embeddings, final norm, lm_head).

    Tied input/output embeddings are one parameter and both live in the root unit. The gradient
    divide factor is 1 on every unit: the loss is already divided by the global count of
    supervised tokens (sft/loss.py), so FSDP must sum, not average, over ranks.
    """
    options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype],
                                                             reduce_dtype=DTYPES[cfg.reduce_dtype]),
                   offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first thing in backward: keep them.
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward and i < len(blocks) - 1, **options)
    # None lets FSDP keep the root unsharded between forward and backward (an explicit True
    # would free and re-gather the embeddings and lm_head every step).
    fully_shard(model, reshard_after_forward=None if cfg.reshard_after_forward else False, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM instead of NCCL's PREMUL_SUM(1): the same result, and gloo supports it.
            module.set_force_sum_reduction_for_comms(True)
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


def parallelize(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, ac_ratio: float,
                compile_blocks: bool, fsdp: FSDPConfig, float8: str = "none") -> None:
    """float8 -> AC -> compile -> FSDP on a meta-device model (see the module docstring for why this
    order). `float8` is precision.float8."""
    if float8 != "none":
        apply_float8(blocks, float8, emulate=mesh.device_type == "cpu")
    blocks = apply_ac(model, blocks, ac_ratio)
    if compile_blocks:
        apply_compile(blocks)
    apply_fsdp(model, blocks, mesh, fsdp)
