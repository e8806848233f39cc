"""Activation checkpointing: which decoder blocks keep only part of their activations for backward
(ac.ratio, `ac_block_indices`), what a checkpointed block keeps (ac.mode, `AC_MODES`): its input
only (whole blocks recomputed), or also the outputs of its expensive ops (op-level, selective), and
where it keeps them (ac.offload, `apply_host_offload`: in host memory).

The one table of modes (sft/config/schema.py:AC_MODES, the values ac.mode takes) is read here by the
policy that checkpoints the blocks (`apply_ac`) and by the planner's costs of each mode
(`kept_bytes_per_token`, `recompute_fraction`). Nothing here needs a GPU or FSDP: the planner
imports it on login nodes.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from sft.config import AC_MODES, ACMode, ConfigError
from sft.distributed import log0

if TYPE_CHECKING:
    from sft.config import ACConfig


# A Llama/Qwen block's matmuls in the order they run, and which width each one's output has: how
# the planner reads a mode's keep_every_matmul (tests/integration/test_distributed.py checks the counts against
# what a real block keeps and reruns).
BLOCK_MATMULS = ("q", "k", "v", "o", "gate", "up", "down")


class BlockShape(Protocol):
    top_k: int  # experts per token (0: a dense block)
    hidden: int
    q_dim: int
    kv_dim: int
    ffn: int
    heads: int


def _output_width(s: BlockShape, matmul: str) -> int:
    """Per token; an MoE block's down projection gives top_k rows per token (its ffn is top_k x the
    expert's intermediate size already)."""
    down = s.hidden * max(1, s.top_k)
    return {"q": s.q_dim, "k": s.kv_dim, "v": s.kv_dim, "o": s.hidden, "gate": s.ffn, "up": s.ffn, "down": down}[matmul]


def kept_matmuls(mode: str) -> tuple[str, ...]:
    every = AC_MODES[mode].keep_every_matmul
    return BLOCK_MATMULS[::every] if every else ()


def kept_bytes_per_token(s: BlockShape, compiled: bool, mode: str) -> int:
    """Bytes per token a block checkpointed in an op-level `mode` keeps until its backward: its
    input, its kept matmuls' outputs and attention's output and log-sum-exp (float32 per head), all
    else bf16. Compiled, the partitioner keeps only what backward reads, and backward never reads
    the down projection's output; eager, selective checkpointing keeps it anyway (and MoE experts
    may run eagerly: sft/parallel/expert_parallel.py, so theirs is counted)."""
    moe = s.top_k > 0
    kept = s.hidden + sum(_output_width(s, m) for m in kept_matmuls(mode) if not (compiled and m == "down" and not moe))
    attention = AC_MODES[mode].keep_attention
    return 2 * (kept + (s.q_dim if attention else 0)) + (4 * s.heads if attention else 0)


def recompute_fraction(s: BlockShape, seq_len: int, mode: str) -> float:
    """What a block checkpointed in `mode` reruns in backward, as a fraction of what a whole
    checkpointed block reruns, by forward FLOPs per token: the matmuls it does not keep (not down,
    whose output backward never reads, so recomputation stops before it) and causal attention
    (2 x seq x q_dim, at max_seq_len: an upper bound for packed or padded rows) unless kept.
    Measured on 2 x H100, P-7B bf16 (4096 tokens): ops_half 0.45 and attention 0.85 of a whole
    block, against 0.46 and 0.92 here; at 32k attention is 42% of what a whole block reruns
    (attention mode 0.58)."""
    flops = {m: s.hidden * _output_width(s, m) for m in BLOCK_MATMULS if m != "down"}
    attention = seq_len * s.q_dim  # half of the row per product (causal), two products, per 2 FLOPs
    rerun = sum(f for m, f in flops.items() if m not in kept_matmuls(mode))
    rerun += 0 if AC_MODES[mode].keep_attention else attention
    return rerun / (sum(flops.values()) + attention)


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
    """(matmuls, attention ops whose outputs op-level checkpointing keeps). Matmuls and attention
    are the work that dominates a block (at 4k tokens the matmuls are ~90% of a 7B block's FLOPs; at
    32k attention is a third); everything else (norms, rotary, SiLU, residual sums, casts) is
    memory-bound and cheap to redo. No collective runs inside a block (FSDP's all-gather and
    reduce-scatter are hooks around it), so none is listed (TorchTitan keeps tensor parallelism's)."""
    aten = torch.ops.aten
    matmuls = frozenset((aten.mm.default, aten.addmm.default, aten.bmm.default,
                         aten._scaled_mm.default,  # float8 matmuls (precision.float8)
                         aten._grouped_mm.default))  # MoE experts (sft/models/moe.py)
    attention = frozenset((
        # float8's amax of a tensor: a scalar, so keeping it is free and spares a full read of the
        # tensor to recompute the scale of its float8 cast.
        aten.max.default,
        # Attention: output and log-sum-exp (what its backward reads) per SDPA backend, and flex
        # attention (packing); the CPU kernel so that CPU tests exercise this path.
        aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch._higher_order_ops.flex_attention,
    ))
    return matmuls, attention


def _selective_context(mode: ACMode, always_kept: frozenset, adapter_widths: frozenset) -> tuple:
    """Fresh selective-checkpoint contexts for one checkpointed forward (checkpoint asks for them on
    each call): the policy counts the matmuls of the forward and of its recomputation apart, so both
    make the same choices. `always_kept`: ops whose outputs are kept in every mode (MoE routing).
    `adapter_widths`: LoRA's rank (and its padded width): a matmul into or out of that width is an
    adapter's, cheap to redo and as wide as its base matmul's output to keep, so it is neither kept
    nor counted (the kept matmuls stay the block's own, as the planner counts them)."""
    matmuls, attention = _expensive_ops()
    seen = {False: 0, True: 0}

    def adapters(func, args) -> bool:
        if not adapter_widths:
            return False
        a, b = args[1:3] if func is torch.ops.aten.addmm.default else args[:2]
        # compiled with dynamic shapes a width may be symbolic (unhashable): never a rank
        return any(type(width) is int and width in adapter_widths for width in (a.shape[-1], b.shape[-1]))

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if not torch.is_grad_enabled():  # nothing to keep for a backward (a tiled MLP's no-grad tiles)
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func in matmuls and mode.keep_every_matmul is not None and adapters(func, args):
            keep = False
        elif func in matmuls and mode.keep_every_matmul is not None:
            seen[ctx.is_recompute] += 1
            keep = mode.keep_every_matmul > 0 and (seen[ctx.is_recompute] - 1) % mode.keep_every_matmul == 0
        else:
            keep = func in always_kept or (mode.keep_attention and func in attention)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """While a checkpointed block runs: what autograd saves of its input (the hidden states, found by
    their storage) is kept in host memory (pinned, where it comes from a GPU) until backward unpacks
    it; everything else saved stays where it is (the rotary tables every block shares, the weights a
    compiled block saves, what op-level checkpointing keeps). Copies run on the current stream
    without a host sync: the copy out is ordered before any later kernel that reuses the memory, the
    copy back before the backward's kernels that read it."""

    def __init__(self, hidden_states: torch.Tensor):
        super().__init__(self._to_host, self._to_device)
        self.storage = hidden_states.untyped_storage().data_ptr()
        self.moved = 0

    def _to_host(self, tensor: torch.Tensor):
        if type(tensor) is not torch.Tensor or tensor.untyped_storage().data_ptr() != self.storage:
            return tensor
        host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
        host.copy_(tensor, non_blocking=True)
        self.moved += 1
        return tensor.device, host

    @staticmethod
    def _to_device(packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)


@functools.cache  # one class (isinstance), made on first use: its base imports FSDP, which the planner does not need
def _host_offloaded_block_class() -> type[nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    class HostOffloaded(ActivationWrapper):
        """A checkpointed block (compiled or not) whose input waits in host memory for its backward:
        the hooks are entered outside the compiled region, so they see the input as checkpointing
        saves it (through autograd's hooks, positional arguments only) and, compiled, as the
        partitioner does. The wrapper's name drops out of parameter names as the checkpoint
        wrapper's does."""

        def forward(self, *args, **kwargs):
            hidden_states = args[0] if args else kwargs.get("hidden_states")
            if not torch.is_grad_enabled() or not isinstance(hidden_states, torch.Tensor):
                return self._checkpoint_wrapped_module(*args, **kwargs)
            offload = _HostOffload(hidden_states)
            with offload:
                out = self._checkpoint_wrapped_module(*args, **kwargs)
            if not offload.moved:  # eager checkpointing keeps keyword arguments out of autograd's hooks
                block = self._checkpoint_wrapped_module._checkpoint_wrapped_module  # inside the checkpoint wrapper
                raise ConfigError(f"ac.offload: {type(block).__name__}'s input was "
                                  "not saved where it can move to host memory (passed by keyword?); set "
                                  "ac.offload=false, or compile.enabled=true")
            return out

    return HostOffloaded


def apply_host_offload(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """ac.offload: each checkpointed block (apply_ac's wrapper, compiled or not) wrapped so that its
    input waits for its backward in host memory; returns the new block list (FSDP shards the
    wrappers)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapper = _host_offloaded_block_class()
    wrapped = []
    for block in blocks:
        if isinstance(block, CheckpointWrapper):
            new = wrapper(block)
            _replace_module(model, block, new)
            block = new
        wrapped.append(block)
    offloaded = sum(isinstance(b, wrapper) for b in wrapped)
    log0(f"ac.offload: {offloaded} checkpointed blocks keep their inputs in host memory" if offloaded else
         "warning: ac.offload moves nothing: no block is checkpointed (ac.ratio picks none of "
         f"{len(wrapped)} blocks); raise ac.ratio")
    return wrapped


def apply_ac(model: nn.Module, blocks: list[nn.Module], ac: ACConfig, always_kept: frozenset = frozenset(),
             adapter_widths: frozenset = frozenset()) -> list[nn.Module]:
    """Wrap the blocks ac.ratio picks in non-reentrant activation checkpointing (ac.mode: the whole
    block recomputed, or only its cheap ops); returns the new block list. `always_kept`: ops whose
    outputs are never recomputed (MoE routing: recomputation must reuse the forward's choice);
    `adapter_widths`: LoRA's (sft/adapters/lora.py: LoRA.widths), whose matmuls op-level modes redo."""
    # Imported here: torch's checkpoint wrapper imports FSDP, which the planner does not need.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    chosen = set(ac_block_indices(len(blocks), ac.ratio))
    mode = AC_MODES[ac.mode]
    # Selective: the contexts tell autograd (or, compiled, the partitioner) which op outputs to keep.
    options = {}
    if mode.keep_every_matmul is not None or always_kept:
        options["context_fn"] = functools.partial(_selective_context, mode, always_kept, adapter_widths)
    wrapped = []
    for i, block in enumerate(blocks):
        if i in chosen:
            new = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)
            _replace_module(model, block, new)
            block = new
        wrapped.append(block)
    log0(f"applied activation checkpointing ({ac.mode}) to {len(chosen)}/{len(blocks)} blocks: {sorted(chosen)}")
    return wrapped
