"""Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid): the kernels they run, and
each packed document restarting their state; the same for Kimi's delta attention (Kimi-Linear), and
for a short convolution where it is a layer's only state (LFM2's ShortConv).

transformers' layers call functions of their modeling module (`causal_conv1d_fn`,
`torch_chunk_gated_delta_rule`, `chunk_kimi_delta_attention`) that it chooses when it first imports the module
(where importing flash-linear-attention (fla) fails then, its slow torch references, without a word: issue #45).
`use_gated_deltanet_kernels` puts ours in their place once per modeling module
(`install_gated_deltanet_functions`): on a GPU with fla, fla's kernels, a packed row's documents given as their
ends (`cu_seqlens`); elsewhere transformers' torch functions, one document at a time, the convolution's taps
into the previous document masked (the CPU path the tests compare). A call carries the documents' ends in the
keyword argument DOCUMENT_ENDS, which transformers passes on from the model's call (the loss passes them for
packed rows of a model whose functions `check_packing` replaced). What each family runs, and what was measured:
docs/training.md, "Layers that carry state along the row".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from types import SimpleNamespace
from typing import NamedTuple

import torch
from packaging.version import Version
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from sft.distributed import gather_along, log0
from sft.errors import UserError

# The keyword argument that carries the documents' ends to the layers (cumulative over the flattened rows).
DOCUMENT_ENDS = "sft_document_ends"
# The activations fla's causal convolution applies (it leaves any other out)
FLA_CONV_ACTIVATIONS = (None, "silu", "swish")


class DocumentEnds(NamedTuple):
    """What DOCUMENT_ENDS carries: the documents' ends (document_ends) on the host and on the device,
    one tensor each for every layer of a forward. flash-linear-attention caches its chunk indices on
    the device tensor's identity and computes them from the host one: no GPU sync, once a forward."""
    on_host: torch.Tensor
    on_device: torch.Tensor


# The keyword argument that carries context parallelism's `RowParts` to the layers
CP_ROWS = "sft_cp_rows"


class RowParts(NamedTuple):
    """Context parallelism: this rank holds parts of each row (sft/parallel/context_parallel.py), and a
    layer that carries state runs the whole row: its inputs are gathered over the cp group
    (`group_name`), put in row order (`row_order`: whole-row position -> gathered position), run as
    the whole row (the documents' `ends` of the whole rows, for packed rows), and this rank keeps its
    own tokens' outputs (`mine`: their whole-row positions, in this rank's order). Every rank runs
    the layer's recurrence over the whole row: exact, and the layer's gradient reaches each rank's
    tokens through the gather's backward."""
    group_name: str
    row_order: torch.Tensor
    mine: torch.Tensor
    ends: DocumentEnds | None

    def whole(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_along(local, dim, self.group_name).index_select(dim, self.row_order)

    def part(self, whole: torch.Tensor, dim: int) -> torch.Tensor:
        return whole.index_select(dim, self.mine)


class KernelError(UserError):
    """Gated DeltaNet layers that cannot run on this GPU; the message names the fix."""


def document_ends(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The cumulative ends of the documents of rows [B, T] flattened into one sequence (int64, as
    flash-linear-attention takes them: [0, end_1, ..., B*T]); positions restart at 0 with every document.
    None for rows of one document each (nothing to keep apart). On the host: no GPU sync."""
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten()
    if len(starts) == position_ids.shape[0]:
        return None
    return torch.cat([starts, torch.tensor([position_ids.numel()])])


# The layers that restart at each packed document, by how their class names end, and the functions of
# their modeling module that this module replaces
RESTARTING_LAYERS = {
    "GatedDeltaNet": ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"),  # Qwen3.5, Qwen3-Next, OLMo-hybrid
    "DeltaAttention": ("causal_conv1d_fn", "chunk_kimi_delta_attention"),  # Kimi-Linear, Ling's hybrids
    "ShortConv": ("causal_conv1d_fn",),  # LFM2: a causal depthwise convolution is all it carries
}


def restarting_modules(model: PreTrainedModel) -> dict[str, list[object]]:
    """For each kind of RESTARTING_LAYERS, the modeling modules of `model`'s layers of that kind that
    define the functions replaced for it, where the layers pass their call's keyword arguments (the
    documents' ends) on to them: LFM2's short convolutions in transformers 5.17 take none, and would
    mix the documents."""
    found: dict[str, set] = {kind: set() for kind in RESTARTING_LAYERS}
    mixing: dict[str, set] = {kind: set() for kind in RESTARTING_LAYERS}
    for m in model.modules():
        for kind in RESTARTING_LAYERS:
            if type(m).__name__.endswith(kind):
                (found if _passes_keywords(type(m)) else mixing)[kind].add(sys.modules[type(m).__module__])
    return {kind: [module for module in modules - mixing[kind]
                   if all(hasattr(module, f) for f in RESTARTING_LAYERS[kind])] for kind, modules in found.items()}


def _passes_keywords(layer: type) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(layer.forward).parameters.values())


@functools.cache
def fla_kernels() -> SimpleNamespace | None:
    """flash-linear-attention's chunked gated delta rule, causal convolution and chunked Kimi delta
    attention (and the keyword arguments the delta rule takes); None where fla is not installed, or
    cannot be imported on a machine without a GPU (its kernels run on GPUs only). Installed beside a
    GPU but broken, it is a KernelError naming why, not a silent fall back to the slow reference."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        delta_rule = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
        conv = importlib.import_module("fla.modules.causal_conv1d").causal_conv1d
    except Exception as e:  # noqa: BLE001 -- whatever fla's import raises: one line
        if not torch.cuda.is_available():
            return None
        raise KernelError(f"flash-linear-attention is installed but cannot be imported ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}): reinstall it (pip install -U flash-linear-attention), "
                          "or uninstall it to run transformers' slow torch reference") from None
    try:
        kda = importlib.import_module("fla.ops.kda").chunk_kda
    except Exception:  # noqa: BLE001 -- an fla without Kimi delta attention: packed, its documents run one at a time
        kda = None
    return SimpleNamespace(delta_rule=delta_rule, conv=torch.compiler.disable(conv), kda=kda,
                           delta_rule_args=frozenset(inspect.signature(delta_rule).parameters),
                           version=importlib.import_module("fla").__version__)


def kernel_problem(model_name: str, capability: tuple[int, int], triton_version: str | None,
                   have_tilelang: bool) -> tuple[str, bool] | None:
    """What keeps a model's Gated DeltaNet layers from flash-linear-attention's kernels on a GPU of this
    compute `capability`, as (one line, whether it stops the run), or None. Without fla
    (`triton_version` None: fla is not importable) they run transformers' torch reference: slow, and
    packed rows one document at a time. fla itself refuses Triton 3.4.0 to 3.7.0 on Hopper without
    tilelang (one of its backward kernels computes wrongly there), at the first backward: here it
    stops before the model is built."""
    if triton_version is None:
        return (f"{model_name}'s Gated DeltaNet layers run transformers' torch reference, which is slow, runs "
                "packed rows one document at a time and keeps several times the memory plan.auto counts for "
                "them: pip install flash-linear-attention", False)
    if capability[0] == 9 and Version("3.4.0") <= Version(triton_version) < Version("3.7.1") and not have_tilelang:
        return (f"{model_name}'s Gated DeltaNet layers: flash-linear-attention refuses Triton {triton_version} on "
                "Hopper GPUs (a backward kernel computes wrongly with it); pip install tilelang, or "
                "triton>=3.7.1", True)
    return None


def install_gated_deltanet_functions(model: PreTrainedModel) -> bool:
    """Put this module's convolution and delta rule in the place of the functions `model`'s Gated
    DeltaNet layers call, its convolution and document-wise Kimi delta attention in the place of those
    of its Kimi delta attention layers, and its convolution in the place of its short convolution
    layers' (once per modeling module); whether it has Gated DeltaNet layers."""
    kernels = fla_kernels()  # resolved here: under torch.compile the functions below only read it
    restarting = restarting_modules(model)
    modules, kimi = restarting["GatedDeltaNet"], restarting["DeltaAttention"]
    for module in {m for found in restarting.values() for m in found}:
        if not getattr(module.causal_conv1d_fn, "by_document", False):
            # Gated DeltaNet's takes fla's kernel for unpacked rows too (transformers' choice can be its torch
            # reference: see above); the others keep transformers' choice for those
            module.causal_conv1d_fn = _conv_by_document(module.causal_conv1d_fn, kernels,
                                                        unpacked_on_fla=module in modules)
        if module in modules and not getattr(module.torch_chunk_gated_delta_rule, "by_document", False):
            module.torch_chunk_gated_delta_rule = _delta_rule_by_document(module.torch_chunk_gated_delta_rule, kernels)
        if module in kimi and not getattr(module.chunk_kimi_delta_attention, "by_document", False):
            module.chunk_kimi_delta_attention = _kimi_delta_by_document(module.chunk_kimi_delta_attention, kernels)
    return bool(modules)


def use_gated_deltanet_kernels(model: PreTrainedModel, device: torch.device) -> None:
    """`model`'s Gated DeltaNet layers on this module's functions (fla's kernels on a GPU), said once;
    on a GPU where they cannot take fla's kernels (kernel_problem), a warning or one line that stops
    the run, before anything is allocated."""
    if not install_gated_deltanet_functions(model) or device.type != "cuda":
        return
    kernels = fla_kernels()
    triton = importlib.import_module("triton").__version__ if kernels is not None else None
    problem = kernel_problem(type(model).__name__, torch.cuda.get_device_capability(device), triton,
                             importlib.util.find_spec("tilelang") is not None)
    if problem and problem[1]:
        raise KernelError(problem[0])
    log0(f"warning: {problem[0]}" if problem else
         f"Gated DeltaNet layers: flash-linear-attention {kernels.version}'s chunked delta rule and causal convolution")


def _document_ids(ends: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[B, T] index of each position's document, from the flattened ends (on the device: no sync)."""
    lengths = ends[1:] - ends[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=ends.device), lengths,
                                   output_size=shape.numel()).view(shape)


def _conv_by_document(original, kernels: SimpleNamespace | None, unpacked_on_fla: bool):
    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None, **kwargs) -> torch.Tensor:
        if (parts := kwargs.pop(CP_ROWS, None)) is not None:  # [B, C, T]: the whole rows' taps
            return parts.part(causal_conv1d_fn(parts.whole(hidden_states, 2), weight, bias, activation,
                                               **{**kwargs, DOCUMENT_ENDS: parts.ends}), 2)
        ends = kwargs.get(DOCUMENT_ENDS)
        # hidden_states [B, C, T] (a transposed view of [B, T, C]), weight [C, K]
        if (kernels is not None and hidden_states.is_cuda and activation in FLA_CONV_ACTIVATIONS
                and (ends is not None or unpacked_on_fla)):
            batch, channels, length = hidden_states.shape
            rows = hidden_states.transpose(1, 2)
            if ends is None:
                out, _ = kernels.conv(rows, weight, bias, activation=activation)
            else:  # the rows as one sequence of documents
                out, _ = kernels.conv(rows.reshape(1, batch * length, channels), weight, bias, activation=activation,
                                      cu_seqlens=ends.on_device, cu_seqlens_cpu=ends.on_host)
            return out.reshape(batch, length, channels).transpose(1, 2)
        if ends is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        # out[t] = sum_j weight[K-1-j] x[t-j], the taps in t's document only
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


def _delta_rule_by_document(original, kernels: SimpleNamespace | None):
    reference = getattr(original, "__wrapped__", original)  # transformers' torch function

    @functools.wraps(original)
    def chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        if (parts := kwargs.pop(CP_ROWS, None)) is not None:  # [B, T, ...]: the whole rows' recurrence
            out, _ = chunk_gated_delta_rule(*(parts.whole(t, 1) for t in (query, key, value, g, beta)),
                                            **{**kwargs, DOCUMENT_ENDS: parts.ends})
            return parts.part(out, 1), None
        ends = kwargs.pop(DOCUMENT_ENDS, None)
        fla = kernels if query.is_cuda else None
        if ends is None:
            if fla is None:  # on a CPU transformers' reference (its choice may be fla, which is GPU-only)
                return (original if query.is_cuda else reference)(query, key, value, g=g, beta=beta, **kwargs)
            return fla.delta_rule(query, key, value, g=g, beta=beta,
                                  **{k: v for k, v in kwargs.items() if k in fla.delta_rule_args})
        l2norm = kwargs.get("use_qk_l2norm_in_kernel", False)
        batch, length = query.shape[:2]
        flat = [t.reshape(1, batch * length, *t.shape[2:]) for t in (query, key, value, g, beta)]
        if fla is not None:
            out, _ = fla.delta_rule(*flat, initial_state=None, output_final_state=False,
                                    use_qk_l2norm_in_kernel=l2norm, cu_seqlens=ends.on_device,
                                    cu_seqlens_cpu=ends.on_host)
        else:  # every document from a zero state, through transformers' own reference
            bounds = ends.on_host.tolist()
            out = torch.cat([reference(*(t[:, start:end] for t in flat), use_qk_l2norm_in_kernel=l2norm)[0]
                             for start, end in zip(bounds[:-1], bounds[1:])], dim=1)
        return out.reshape(batch, length, *out.shape[2:]), None

    chunk_gated_delta_rule.by_document = True
    return chunk_gated_delta_rule


def _kimi_delta_by_document(original, kernels: SimpleNamespace | None):
    reference = getattr(original, "__wrapped__", original)  # transformers' torch function
    varlen = kernels.kda if kernels is not None else None

    @torch.compiler.disable  # a loop over the row's documents: compiled, it would recompile for every packing
    def by_document(function, flat: list[torch.Tensor], ends: torch.Tensor, **kwargs) -> torch.Tensor:
        lengths = (ends[1:] - ends[:-1]).tolist()  # split, not sliced: one concatenation in backward
        return torch.cat([function(q, k, v, g=g, beta=beta, **kwargs)[0]
                          for q, k, v, g, beta in zip(*(t.split(lengths, dim=1) for t in flat))], dim=1)

    @functools.wraps(original)
    def chunk_kimi_delta_attention(query, key, value, g, beta, **kwargs):
        if (parts := kwargs.pop(CP_ROWS, None)) is not None:  # [B, T, ...]: the whole rows' recurrence
            out, _ = chunk_kimi_delta_attention(*(parts.whole(t, 1) for t in (query, key, value, g, beta)),
                                                **{**kwargs, DOCUMENT_ENDS: parts.ends})
            return parts.part(out, 1), None
        ends = kwargs.pop(DOCUMENT_ENDS, None)
        function = original if query.is_cuda else reference  # (transformers' choice may be fla: GPU-only)
        if ends is None:
            return function(query, key, value, g=g, beta=beta, **kwargs)
        batch, length = query.shape[:2]
        flat = [t.reshape(1, batch * length, *t.shape[2:]) for t in (query, key, value, g, beta)]
        # every document from a zero state, as if it had a row of its own
        if query.is_cuda and varlen is not None:  # fla's kernel, the documents as its sequences: one call
            out, _ = varlen(*flat, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=kwargs.get("use_qk_l2norm_in_kernel", False),
                            cu_seqlens=ends.on_device, cu_seqlens_cpu=ends.on_host)
        else:
            out = by_document(function, flat, ends.on_host, **kwargs)
        return out.reshape(batch, length, *out.shape[2:]), None

    chunk_kimi_delta_attention.by_document = True
    return chunk_kimi_delta_attention
