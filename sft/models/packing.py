"""What packing needs of a model: attention that keeps the documents of a packed row apart, and
layers that carry state along a row restarted at each document.

A packed row holds several documents whose positions restart at 0. transformers' attention keeps
them apart when the model builds its masks from the position ids (masking_utils finds the
documents there): most models do. gpt-oss builds its masks without them but takes masks built
beforehand, which the loss builds from the positions (`Packing.masks`). Older architectures (BLOOM,
OPT, MPT) have no such masks. `check_packing` asks the model itself and refuses those in one line.

A recurrent or convolutional layer does not look at positions: it carries its state from one document
into the next. Gated DeltaNet, Kimi delta attention and LFM2's short convolutions restart at each
document given the documents' ends (sft/models/gated_deltanet.py): `check_packing` puts their
document-aware functions in place and says that the loss must pass them the ends.

Any other layer that carries state is refused for packing in one line, and by context parallelism
(`cp_unsupported`, its one rule), which runs the layers above over whole rows.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel, masking_utils

from sft.errors import UserError
from sft.models.architecture import decoder, text_config
from sft.models.gated_deltanet import install_gated_deltanet_functions, restarting_modules
from sft.models.layers import attention_kinds, attention_layer_count, stateful_kinds
from sft.models.moe import sparse_modules

# Mixers that carry state along a row, by a part of their class name (for configs that name no layer kinds).
_STATEFUL_MIXERS = ("Mamba", "Mixer", "GatedDeltaNet", "ShortConv", "LightningAttention", "LinearAttention",
                    "DeltaAttention", "Rglru")


class PackingError(UserError):
    """A model whose layers cannot be packed as configured; the message names the layers and the fix."""


@dataclass(frozen=True)
class Packing:
    """What packed rows need from the loss (sft/training/loss.py)."""
    document_ends: bool = False  # the documents' ends, passed to the layers that restart per document
    masks: tuple[str, ...] = ()  # the layer kinds whose attention masks it builds from the positions


ONE_DOCUMENT_A_ROW = Packing()


def _masks_from_positions(model: PreTrainedModel) -> tuple[str, ...] | None:
    """The layer kinds (full or sliding-window attention) whose masks the loss builds for `model`, where its
    forward takes a dict of masks by layer kind built beforehand (as `generate` prepares them); else None."""
    class Watched(dict):
        def __getitem__(self, kind):
            raise _Reached

    kinds = tuple(sorted(attention_kinds(text_config(model.config))))
    takes = kinds and set(kinds) <= {"full_attention", "sliding_attention"}
    return kinds if takes and _reaches(model, positions_on_host=False, attention_mask=Watched()) else None


def _stateful_mixers(model: PreTrainedModel) -> dict[str, type]:
    """The classes of `model`'s modules that carry state along a row, by name: the innermost modules
    whose class names say so (not the blocks or the model around them, nor norms named after them, nor
    attention named so: Kimi-Linear's KimiLinearAttention is its full attention, and says is_causal)."""
    def named(module) -> bool:
        name = type(module).__name__
        return (any(k in name for k in _STATEFUL_MIXERS) and not name.endswith(("Norm", "NormGated"))
                and not hasattr(module, "is_causal"))
    return {type(m).__name__: type(m) for m in model.modules()
            if named(m) and not any(named(inner) for inner in m.modules() if inner is not m)}


def stateful_layers(model: PreTrainedModel) -> str | None:
    """The layers of `model` that carry state along a row, named for a message; None when every
    layer attends or is an MLP."""
    kinds = stateful_kinds(model.config)
    mixers = sorted(_stateful_mixers(model))
    if not kinds and not mixers:
        return None
    named = f" ({', '.join(mixers)})" if mixers else ""
    return f"{type(model).__name__}'s {' and '.join(sorted(kinds) or ['recurrent'])} layers{named}"


def _packs_exactly(model: PreTrainedModel) -> bool:
    """Whether every layer of `model` that carries state is a Gated DeltaNet, Kimi delta attention or
    short convolution layer that restarts per document (sft/models/gated_deltanet.py)."""
    mixers = _stateful_mixers(model)
    if not mixers:  # the config names stateful layer kinds (e.g. Falcon-H1's "hybrid"), no module of a known kind
        return False
    exact = restarting_modules(model)
    return all(any(name.endswith(kind) and sys.modules[cls.__module__] in modules for kind, modules in exact.items())
               for name, cls in mixers.items())


class _Reached(Exception):
    """A probe's: the forward stops where it reaches what is watched (no layer runs on meta tensors)."""


def _reaches(model: PreTrainedModel, **kwargs) -> bool:
    """Whether `_probe_forward(model, **kwargs)` reaches a probe (raises _Reached)."""
    try:
        with torch.no_grad():
            _probe_forward(model, **kwargs)
    except _Reached:
        return True
    except Exception:  # noqa: BLE001 -- past the masks, meta and real tensors meet: it never got there
        pass
    return False


def builds_document_masks(model: PreTrainedModel) -> bool:
    """Whether `model` builds its attention masks from the position ids (so that packed documents do not see
    each other): its forward is run on a packed row's positions, watching whether transformers looks."""
    def watched(position_ids: torch.Tensor):
        raise _Reached

    find = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = watched
    try:
        return _reaches(model)
    finally:
        masking_utils.find_packed_sequence_indices = find


def _probe_forward(model: PreTrainedModel, positions_on_host: bool = True, **kwargs) -> None:
    """`model`'s decoder on a packed row of 4 tokens, on the model's device (the meta device while it is
    built: nothing is computed), the positions on the host or there too: what the probes watch."""
    device = next(model.parameters()).device
    positions = torch.tensor([[0, 1, 0, 1]], device="cpu" if positions_on_host else device)
    decoder(model)[1](input_ids=torch.ones((1, 4), dtype=torch.long, device=device), position_ids=positions,
                      use_cache=False, **kwargs)


def _attention_unsplittable(model: PreTrainedModel) -> str | None:
    """Why `model`'s attention cannot take context parallelism's, or None: its own forward is run with
    a probe in the place of transformers' attention interface (`model`'s attention stays the probe:
    a copy), which its first attention layer must reach, given the model call's keyword arguments
    (context parallelism passes its masks so), no mask of the layer's own making (transformers
    builds none for the probe) and the layer's sliding window where the config sets one."""
    class Reached(Exception):
        pass

    window = getattr(text_config(model.config), "sliding_window", None)

    def probe(module, query, key, value, attention_mask, **kwargs):  # the forward stops at the first attention layer
        if _PROBE not in kwargs:
            raise Reached("attention layers are not given the keyword arguments of the model's call (in this "
                          "transformers), through which context parallelism passes its masks")
        if attention_mask is not None:
            raise Reached("attention layers build an attention mask of their own")
        if window and "sliding_window" not in kwargs and not hasattr(module, "sliding_window"):
            raise Reached(f"attention layers leave their sliding window ({window}) to transformers' masks")
        raise Reached(None)

    AttentionInterface.register(_PROBE, probe)
    model.config._attn_implementation = _PROBE
    # What may come before the first attention layer and cannot run on the meta device (a hybrid's layers
    # that carry state, routed experts): passed through
    mixers = tuple(_stateful_mixers(model).values())
    for module in [m for m in model.modules() if isinstance(m, mixers)] + [m for _, m in sparse_modules(model)]:
        module.forward = _passed_through
    try:
        with torch.no_grad():
            _probe_forward(model, positions_on_host=False, **{_PROBE: True})  # one device: the layers run
    except Reached as reached:
        return reached.args[0]
    except Exception:  # noqa: BLE001 -- it failed before any attention layer (on meta: mixed devices)
        pass
    return None if attention_layer_count(model.config) == 0 else (
        "attention layers were not reached through transformers' attention interface")


_PROBE = "sft_attention_probe"


def _passed_through(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden_states


def check_packing(model: PreTrainedModel, packing: bool) -> Packing:
    """data.packing: the model's attention keeps documents apart, and its layers that carry state
    restart at each document (sft/models/gated_deltanet.py); else one line naming what mixes them. Returns
    what packed rows need from the loss."""
    if not packing:
        return ONE_DOCUMENT_A_ROW
    masks = ()
    if not builds_document_masks(model) and (masks := _masks_from_positions(model)) is None:
        raise PackingError(f"data.packing=true: {type(model).__name__} does not build its attention masks from the "
                           "position ids where packed documents restart (in this transformers), so its documents "
                           "would see each other; set data.packing=false")
    if not (layers := stateful_layers(model)):
        return Packing(masks=masks)
    if not _packs_exactly(model):
        raise PackingError(f"data.packing=true: {layers} carry their state from one packed document into the next, "
                           "mixing documents, and only Gated DeltaNet, Kimi delta attention and short convolution "
                           "layers that pass on their call's keyword arguments (transformers 5.24's do) restart per "
                           "document yet; set data.packing=false")
    install_gated_deltanet_functions(model)  # given a row's document ends, its layers restart there
    return Packing(document_ends=True, masks=masks)


def cp_unsupported(model: PreTrainedModel) -> str | None:
    """Why context parallelism cannot split this model's rows, or None. The one rule: context
    parallelism refuses these, and the planner never suggests a cp.degree for them. (Mixture-of-
    experts blocks split: each token goes through its experts wherever it is, and the load-balancing
    term counts the whole row, sft/models/moe.py.)"""
    config = text_config(model.config)
    # Layers that carry state run the whole row where they restart per document (RowParts); others not
    if (layers := stateful_layers(model)) and not _packs_exactly(model):
        return f"{layers} carry state along the row"
    if partial := sorted(attention_kinds(config) - {"full_attention", "sliding_attention"}):  # chunks, an indexer
        return f"{type(model).__name__}'s {', '.join(partial)} layers see parts of the row of their own choosing"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout is not supported (set the model's attention_dropout to 0)"
    # The probes run a copy (on meta: no data) under transformers' SDPA: the architecture, whatever
    # attention this run chose (unpacked rows' causal SDPA builds no mask); and the layers before the
    # first attention may reassign buffers (CTRL's positional encoding), which materialising would miss.
    probed = copy.deepcopy(model)
    probed.config._attn_implementation = "sdpa"
    # Positions from the position ids: rotary embeddings are computed from them, and a model that builds its
    # masks from them reads them (refused: ALiBi, positions counted from the input's shape)
    rotary = any(type(module).__name__.endswith("RotaryEmbedding") for module in model.modules())
    if not (rotary or builds_document_masks(probed)):
        return (f"{type(model).__name__} neither takes rotary positions from the position ids nor builds its masks "
                "from them (in this transformers)")
    if reason := _attention_unsplittable(probed):
        return f"{type(model).__name__}'s {reason}"
    return None
