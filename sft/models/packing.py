"""What packing needs of a model: attention that keeps the documents of a packed row apart, and
layers that carry state along a row restarted at each document.

A packed row holds several documents whose positions restart at 0. transformers' attention keeps
them apart when the model builds its masks from the position ids (masking_utils finds the
documents there): most models do; some do not (gpt-oss in transformers 5.24 builds its masks
without them; older architectures such as BLOOM, OPT, MPT have no such masks). `check_packing`
asks the model itself (`builds_document_masks`) and refuses the others in one line.

A recurrent or convolutional layer does not look at positions: Gated DeltaNet (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid), Mamba hybrids, lightning and kimi delta attention carry
their state from one document into the next. Gated DeltaNet is packed exactly: every document
restarts its recurrent state and its short convolution, as if it had a row of its own.

transformers' Gated DeltaNet layers call two functions of their modeling module,
`causal_conv1d_fn` and `torch_chunk_gated_delta_rule` (which transformers replaces by
flash-linear-attention's kernel where installed), passing on the keyword arguments the model was
called with. `enable_exact_packing` puts document-aware versions in their place, used when a call
carries the documents' ends (`DOCUMENT_ENDS`, which sft/training/loss.py passes for packed rows)
and the originals otherwise:

* the convolution: each output sums the kernel's taps over its own document only (the taps that
  reach into the previous document are masked), in torch on any device;
* the gated delta rule: on GPUs flash-linear-attention's varlen kernel (`cu_seqlens`: the
  documents of the flattened rows) where it is installed; else transformers' torch reference
  one document at a time (a CPU path, for the tests: every document's state starts at zero).

Any other layer that carries state is refused for packing in one line. Context parallelism, which
splits rows rather than packing them, refuses every such layer (`cp_unsupported`, its one rule).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import NamedTuple

import torch
from packaging.version import Version
from transformers import PreTrainedModel, masking_utils
from transformers.activations import ACT2FN

from sft.distributed import log0
from sft.errors import UserError
from sft.models.build import attends_fully, decoder

# Layer kinds (config.layer_types, as transformers names them) that carry nothing along a row: a
# packed document sees only itself once its positions restart.
STATELESS_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe"})
# Mixers that carry state along a row, by a part of their class name (for configs without layer_types).
_STATEFUL_MIXERS = ("Mamba", "Mixer", "GatedDeltaNet", "ShortConv", "LightningAttention", "LinearAttention",
                    "DeltaAttention", "Rglru")
# The keyword argument that carries the documents' ends to the layers (cumulative over the flattened rows).
DOCUMENT_ENDS = "sft_document_ends"


class DocumentEnds(NamedTuple):
    """What DOCUMENT_ENDS carries: the documents' ends (document_ends) on the host and on the device,
    one tensor each for every layer of a forward. flash-linear-attention caches its chunk indices on
    the device tensor's identity and computes them from the host one: no GPU sync, once a forward."""
    on_host: torch.Tensor
    on_device: torch.Tensor


class PackingError(UserError):
    """A model whose layers cannot be packed as configured; the message names the layers and the fix."""


def _stateful_mixers(model: PreTrainedModel) -> dict[str, type]:
    """The classes of `model`'s modules that carry state along a row, by name: the innermost modules
    whose class names say so (not the blocks or the model around them, nor norms named after them)."""
    def named(module) -> bool:
        name = type(module).__name__
        return any(k in name for k in _STATEFUL_MIXERS) and not name.endswith(("Norm", "NormGated"))
    return {type(m).__name__: type(m) for m in model.modules()
            if named(m) and not any(named(inner) for inner in m.modules() if inner is not m)}


def stateful_layers(model: PreTrainedModel) -> str | None:
    """The layers of `model` that carry state along a row, named for a message; None when every
    layer attends or is an MLP."""
    kinds = set(getattr(model.config.get_text_config(), "layer_types", None) or []) - STATELESS_LAYERS
    mixers = sorted(_stateful_mixers(model))
    if not kinds and not mixers:
        return None
    named = f" ({', '.join(mixers)})" if mixers else ""
    return f"{type(model).__name__}'s {' and '.join(sorted(kinds) or ['recurrent'])} layers{named}"


def _exact_modules(model: PreTrainedModel) -> list[object] | None:
    """The modeling modules whose stateful layers this module packs exactly (Gated DeltaNet calling
    the module's two functions); None if any stateful layer is of another kind, or cannot be named."""
    mixers = _stateful_mixers(model)
    if not mixers:  # the config names stateful layer kinds (e.g. Falcon-H1's "hybrid"), no module of a known kind
        return None
    modules = []
    for name, cls in mixers.items():
        module = sys.modules[cls.__module__]
        if "GatedDeltaNet" not in name or not all(hasattr(module, f) for f in ("causal_conv1d_fn",
                                                                                "torch_chunk_gated_delta_rule")):
            return None
        modules.append(module)
    return modules


def builds_document_masks(model: PreTrainedModel) -> bool:
    """Whether `model` builds its attention masks from the position ids, so that the documents of a
    packed row do not see each other: its own forward is run (on the meta device: nothing is
    computed) on a packed row's positions, watching whether transformers looks for the documents."""
    class Looked(Exception):
        pass

    def watched(position_ids: torch.Tensor):
        raise Looked  # the forward stops here: no layer runs (a GPU kernel given meta tensors would fault)

    find = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = watched
    try:
        with torch.no_grad():
            decoder(model)[1](input_ids=torch.ones((1, 4), dtype=torch.long, device="meta"),
                             position_ids=torch.tensor([[0, 1, 0, 1]]), use_cache=False)
    except Looked:
        return True
    except Exception:  # noqa: BLE001 -- past the masks, meta and real tensors meet: it never looked
        pass
    finally:
        masking_utils.find_packed_sequence_indices = find
    return False


def check_packing(model: PreTrainedModel, packing: bool) -> None:
    """data.packing: the model's attention keeps documents apart, and its layers that carry state
    restart at each document (enable_exact_packing); else one line naming what mixes them."""
    if not packing:
        return
    if not builds_document_masks(model):
        raise PackingError(f"data.packing=true: {type(model).__name__} does not build its attention masks from the "
                           "position ids where packed documents restart (in this transformers), so its documents "
                           "would see each other; set data.packing=false")
    if not (layers := stateful_layers(model)):
        return
    if _exact_modules(model) is None:
        raise PackingError(f"data.packing=true: {layers} carry their state from one packed document into the next, "
                           "mixing documents, and only Gated DeltaNet layers restart per document yet; set "
                           "data.packing=false")
    enable_exact_packing(model)


def enable_exact_packing(model: PreTrainedModel) -> None:
    """Put the document-aware convolution and delta rule in the place of the functions `model`'s
    Gated DeltaNet layers call (once per modeling module)."""
    model.sft_document_ends = True  # its packed rows pass their documents' ends (sft/training/loss.py)
    for module in _exact_modules(model) or []:
        if not getattr(module.causal_conv1d_fn, "by_document", False):
            module.causal_conv1d_fn = _conv_by_document(module.causal_conv1d_fn)
            module.torch_chunk_gated_delta_rule = _delta_rule_by_document(module.torch_chunk_gated_delta_rule)


def document_ends(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The cumulative ends of the documents of rows [B, T] flattened into one sequence (int64, as
    flash-linear-attention takes them: [0, end_1, ..., B*T]); positions restart at 0 with every document.
    None for rows of one document each (nothing to keep apart). On the host: no GPU sync."""
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten()
    if len(starts) == position_ids.shape[0]:
        return None
    return torch.cat([starts, torch.tensor([position_ids.numel()])])


def _document_ids(ends: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[B, T] index of each position's document, from the flattened ends (on the device: no sync)."""
    lengths = ends[1:] - ends[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=ends.device), lengths,
                                   output_size=shape.numel()).view(shape)


def _conv_by_document(original):
    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None, **kwargs) -> torch.Tensor:
        ends = kwargs.get(DOCUMENT_ENDS)
        if ends is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        # hidden_states [B, C, T], weight [C, K]: out[t] = sum_j weight[K-1-j] x[t-j], taps in t's document only
        batch, _, length = hidden_states.shape
        document = _document_ids(ends.on_device, torch.Size((batch, length)))
        x = hidden_states.to(weight.dtype)
        kernel = weight.shape[-1]
        out = x * weight[:, kernel - 1, None]
        for j in range(1, min(kernel, length)):
            same = (document[:, j:] == document[:, :-j]).unsqueeze(1)  # [B, 1, T-j]
            out[..., j:] += x[..., :-j] * weight[:, kernel - 1 - j, None] * same
        if bias is not None:
            out = out + bias[:, None]
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.to(hidden_states.dtype)

    causal_conv1d_fn.by_document = True
    return causal_conv1d_fn


@functools.cache
def fla_delta_rule():
    """flash-linear-attention's chunked gated delta rule, None where it is not installed."""
    try:
        return importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except ImportError:
        return None


def delta_rule_kernel_problem(model_name: str, capability: tuple[int, int], triton_version: str | None,
                              have_tilelang: bool) -> tuple[str, bool] | None:
    """What keeps a model's Gated DeltaNet layers from flash-linear-attention's kernels on a GPU of this
    compute `capability`, as (one line, whether it stops the run), or None. Without fla
    (`triton_version` None: fla is not importable) transformers runs its torch reference: slow, and
    packed rows one document at a time. fla itself refuses Triton 3.4.0 to 3.7.0 on Hopper without
    tilelang (one of its backward kernels computes wrongly there), at the first backward: here it
    stops before the model is built."""
    if triton_version is None:
        return (f"{model_name}'s Gated DeltaNet layers run transformers' torch reference, which is slow (and runs "
                "packed rows one document at a time): pip install flash-linear-attention", False)
    if capability[0] == 9 and Version("3.4.0") <= Version(triton_version) < Version("3.7.1") and not have_tilelang:
        return (f"{model_name}'s Gated DeltaNet layers: flash-linear-attention refuses Triton {triton_version} on "
                "Hopper GPUs (a backward kernel computes wrongly with it); pip install tilelang, or "
                "triton>=3.7.1", True)
    return None


def check_delta_rule_kernels(model: PreTrainedModel, device: torch.device) -> None:
    """On a GPU, one line before anything is allocated where a Gated DeltaNet model's layers cannot
    take flash-linear-attention's kernels (delta_rule_kernel_problem): a warning, or an error."""
    if device.type != "cuda" or not any("GatedDeltaNet" in name for name in _stateful_mixers(model)):
        return
    triton = importlib.import_module("triton").__version__ if fla_delta_rule() is not None else None
    problem = delta_rule_kernel_problem(type(model).__name__, torch.cuda.get_device_capability(device), triton,
                                        importlib.util.find_spec("tilelang") is not None)
    if problem and problem[1]:
        raise PackingError(problem[0])
    if problem:
        log0(f"warning: {problem[0]}")


def _delta_rule_by_document(original):
    reference = getattr(original, "__wrapped__", original)  # transformers' torch function

    @functools.wraps(original)
    def chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        ends = kwargs.pop(DOCUMENT_ENDS, None)
        if ends is None:  # transformers' choice, but on a CPU its reference (flash-linear-attention is GPU-only)
            return (original if query.is_cuda else reference)(query, key, value, g=g, beta=beta, **kwargs)
        l2norm = kwargs.get("use_qk_l2norm_in_kernel", False)
        batch, length = query.shape[:2]
        flat = [t.reshape(1, batch * length, *t.shape[2:]) for t in (query, key, value, g, beta)]
        fla = fla_delta_rule()
        if fla is not None and query.is_cuda:
            out, _ = fla(*flat, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=l2norm,
                         cu_seqlens=ends.on_device, cu_seqlens_cpu=ends.on_host)
        else:  # every document from a zero state, through transformers' own reference
            bounds = ends.on_host.tolist()
            out = torch.cat([reference(*(t[:, start:end] for t in flat), use_qk_l2norm_in_kernel=l2norm)[0]
                             for start, end in zip(bounds[:-1], bounds[1:])], dim=1)
        return out.reshape(batch, length, *out.shape[2:]), None

    return chunk_gated_delta_rule


def cp_unsupported(model: PreTrainedModel, moe: bool) -> str | None:
    """Why context parallelism cannot split this model's rows, or None (`moe`: a mixture-of-experts
    model). The one rule: context parallelism refuses these, and the planner never suggests a
    cp.degree for them."""
    config = model.config.get_text_config()
    if moe:  # the load-balancing statistics count whole rows (sft/models/moe.py)
        return "mixture-of-experts models are not supported yet"
    if layers := stateful_layers(model):  # their state would have to pass from one cp rank to the next
        return f"{layers} carry state along the row"
    if not attends_fully(model):
        return f"{type(model).__name__} has sliding-window or soft-capped attention layers"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout is not supported (set the model's attention_dropout to 0)"
    return None
