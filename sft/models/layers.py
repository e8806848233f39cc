"""What each kind of layer does, by the names transformers' configs give them (`config.layer_types`):
the one table that attention FLOPs (MFU), the maskless causal kernel, packing, context parallelism
and the planner read. A config without layer_types attends in every layer; a kind this table does not
know counts as attending and as carrying state (packing and context parallelism refuse it, naming it).

Which modules restart their state per packed document, and how, is sft/models/gated_deltanet.py's
(RESTARTING_LAYERS: by class name; configs name them "linear_attention" or "conv" whatever their mixer)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from sft.models.architecture import text_config


@dataclass(frozen=True)
class LayerKind:
    attends: bool
    """runs attention over the row: counted in attention FLOPs, given the attention mask"""
    carries_state: bool
    """passes a state along the row (a recurrence, a convolution): a packed document would read the
    one before it unless the layer restarts there, and context parallelism would have to pass it on"""
    recurrent_bytes: bool = False
    """the planner counts its kept bytes as a Gated DeltaNet block's (sft/plan/memory.py)"""


LAYER_KINDS = {
    "full_attention": LayerKind(attends=True, carries_state=False),
    "attention": LayerKind(attends=True, carries_state=False),
    "sliding_attention": LayerKind(attends=True, carries_state=False),
    "chunked_attention": LayerKind(attends=True, carries_state=False),
    # DeepSeek-V3.2: sparse attention whose indexer picks each token's keys among those the mask allows
    "indexed_attention": LayerKind(attends=True, carries_state=False),
    # Nemotron-H's MLP and MoE layers
    "mlp": LayerKind(attends=False, carries_state=False),
    "moe": LayerKind(attends=False, carries_state=False),
    # Gated DeltaNet (Qwen3.5, Qwen3-Next), Kimi delta attention, Mamba mixers
    "linear_attention": LayerKind(attends=False, carries_state=True, recurrent_bytes=True),
    "conv": LayerKind(attends=False, carries_state=True),  # LFM2's short convolutions
    "mamba": LayerKind(attends=False, carries_state=True),
    "recurrent": LayerKind(attends=False, carries_state=True),
    # Falcon-H1: attention beside a Mamba mixer in the same layer
    "hybrid": LayerKind(attends=True, carries_state=True),
}
UNKNOWN_KIND = LayerKind(attends=True, carries_state=True)


def layer_kinds(config: PretrainedConfig) -> list[str]:
    """The kind of each layer of the (text) model `config` describes."""
    text = text_config(config)
    return list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)


def kind_of(name: str) -> LayerKind:
    return LAYER_KINDS.get(name, UNKNOWN_KIND)


def attention_layer_count(config: PretrainedConfig) -> int:
    """How many layers attend."""
    return sum(kind_of(kind).attends for kind in layer_kinds(config))


def stateful_kinds(config: PretrainedConfig) -> set[str]:
    """The kinds of `config`'s layers that carry state along a row."""
    return {kind for kind in layer_kinds(config) if kind_of(kind).carries_state}


def attention_kinds(config: PretrainedConfig) -> set[str]:
    """The kinds of `config`'s layers that attend."""
    return {kind for kind in layer_kinds(config) if kind_of(kind).attends}


def recurrent_byte_blocks(config: PretrainedConfig) -> tuple[int, ...]:
    """The indices of the layers the planner counts as Gated DeltaNet blocks."""
    return tuple(i for i, kind in enumerate(layer_kinds(config)) if kind_of(kind).recurrent_bytes)
