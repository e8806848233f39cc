"""The values of ac.mode and what a block checkpointed in each keeps: the one table, read by the
config (its allowed values), the checkpointing policy and the planner's costs of each mode
(sft/parallel/activation_checkpointing.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ACMode:
    """What a block checkpointed in this mode keeps for its backward, besides its input."""
    keep_every_matmul: int | None
    """None: nothing, the whole block is recomputed; 0: no matmul output; n: the outputs of the 1st,
    (n+1)-th, ... matmul of the block, in the order they run"""
    keep_attention: bool
    """attention's output and log-sum-exp (what its backward reads), so it is never rerun"""


AC_MODES = {
    # The least memory: every activation of the block is recomputed in backward.
    "blocks": ACMode(keep_every_matmul=None, keep_attention=False),
    # Almost nothing but the cheap ops (norms, rotary, SiLU) is recomputed, at ~70% of an unchecked
    # block's activations (Qwen2.5-7B shapes).
    "ops": ACMode(keep_every_matmul=1, keep_attention=True),
    # TorchTitan's default: in a Llama/Qwen block q, v, gate and down are kept; k, o and up (~35% of
    # the block's matmul FLOPs) are recomputed, at ~40% of the activations.
    "ops_half": ACMode(keep_every_matmul=2, keep_attention=True),
    # Only attention's output: at 32k tokens attention is a third of a block's forward FLOPs, and it
    # is not rerun, for one bf16 vector per token.
    "attention": ACMode(keep_every_matmul=0, keep_attention=True),
}
