"""The one table of the mixture-of-experts architectures we know: how each stores, routes and
names its experts. sft/models/moe.py runs them; sft/models/hub.py maps their hub files."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    """How an architecture's sparse block stores and uses its experts."""
    router: str                # the router's attribute on the block
    transposed: bool = False   # expert weights [E, in, out] instead of [E, out, in]
    interleaved: bool = False  # gate/up alternate along gate_up_proj's output instead of [gate; up]
    biased: bool = False       # experts and router have biases
    softmax_of_top_k: bool = False  # softmax over the k largest logits, not top-k of the softmax
    returns_scores: bool = False    # the block returns (hidden states, router scores)
    # The hub's files (and exports) hold one tensor per expert, named (the block's name there if not
    # mlp, gate, up, down: sft/models/hub.py); None: fused, as transformers loads them.
    hub_experts: tuple[str, str, str, str] | None = None


# The one table of the mixture-of-experts architectures we know.
LAYOUTS = {
    "qwen3_moe": ExpertLayout(router="gate", hub_experts=("", "gate_proj", "up_proj", "down_proj")),
    "mixtral": ExpertLayout(router="gate", hub_experts=("block_sparse_moe", "w1", "w3", "w2")),
    "gpt_oss": ExpertLayout(router="router", transposed=True, interleaved=True, biased=True, softmax_of_top_k=True,
                            returns_scores=True),
}
