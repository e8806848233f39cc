"""Context parallelism: the tokens of one row split over the `cp.degree` ranks of a cp group, so a
row longer than one GPU's activations (64k-128k tokens of a reasoning trace) still trains.

Layout. The mesh's `cp` axis (sft/parallel/mesh.py): consecutive runs of cp.degree ranks, so a
cp group sits inside a node. Every rank of a group reads the same rows (the data sampler sees
world / degree data-parallel ranks) and keeps its share of each: the row is cut into 2 * degree
chunks and cp rank r keeps chunks r and 2 * degree - 1 - r (head-tail), so every rank gets the
same amount of causal attention work. Positions, document boundaries and the shifted targets are
computed on the whole row before the split: hidden state t predicts label t + 1 even where t and
t + 1 land on different ranks, and a document's last token never predicts the next document's
first (its label is already ignored, sft/data/collate.py).

Attention. Each rank computes Q, K, V for its own tokens; K and V (small under GQA: 1/7 of the
hidden size on Qwen2.5-7B) are all-gathered over the cp group, and the rank's queries attend to
the whole row with a mask built from whole-row indices: causal on the row's token order, and
within one document (packing). All-gather rather than ring or head all-to-all (Ulysses): one
collective per layer whose backward is one reduce-scatter, any number of heads and any mask, and
on GPUs the mask is a flex-attention block mask, so fully masked blocks (other documents, the
future) cost nothing. On CPU (tests) the same mask is a dense boolean tensor for SDPA: flex
attention has no CPU backward.

Mixture-of-experts blocks run on each rank's tokens (expert parallelism sends them from wherever
they are); the load-balancing term counts the whole rows (sft/models/moe.py). Layers that carry
state run the whole rows from gathered inputs (sft/models/gated_deltanet.py: RowParts).

Loss. Each rank sums the cross-entropy of its own supervised tokens and divides by the global
count (sft/training/loss.py): every token is counted on exactly one rank, FSDP sums the gradients
over all ranks (it shards over dp x cp), and the K/V gather's backward returns each rank the
gradient of its keys and values from every query of the row. Nothing is counted twice.
Checkpoints are FSDP shards over all ranks whatever the degree: a run resumes at another degree.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, create_mask, flex_attention
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from sft.config import ConfigError
from sft.data.masking import IGNORE_INDEX
from sft.distributed import gather_along, log0
from sft.models.architecture import text_config
from sft.models.gated_deltanet import document_ends
from sft.models.packing import cp_unsupported
from sft.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from sft.models.moe import MoE

# The attention implementation name under which transformers calls `_attention`.
CP_ATTENTION = "sft_context_parallel"
# What an attention layer may pass that changes its result and `_attention` does not apply (a
# position bias): a layer that passes one is refused.
_NOT_APPLIED = ("position_bias",)


def _chunks(degree: int, cp_rank: int, chunk: int) -> torch.Tensor:
    """Whole-row indices of the tokens cp rank `cp_rank` keeps (head-tail chunks)."""
    tail = 2 * degree - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange(tail * chunk, (tail + 1) * chunk)])


def _padding(length: int, dims: ParallelDims) -> int:
    """Tokens a row of `length` is padded with at its end: to a multiple of 2 * cp."""
    return -length % (2 * dims.cp)


def rank_share(values: torch.Tensor, dims: ParallelDims, fill: int = 0) -> torch.Tensor:
    """This cp rank's tokens of [rows x length] `values`, the rows padded at the end with `fill`."""
    padded = F.pad(values, (0, _padding(values.shape[1], dims)), value=fill)
    return padded[:, _chunks(dims.cp, dims.cp_rank, padded.shape[1] // (2 * dims.cp))]


def shard_rows(rows: dict[str, torch.Tensor], dims: ParallelDims
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor | None]:
    """(this rank's share of {input_ids, position_ids, targets} [rows x length], the layout
    `attention_masks` needs, the whole rows' document ends for the layers that carry state or None:
    sft/models/gated_deltanet.py). Rows are padded at the end to a multiple of 2 * cp; the padding
    continues the last document's positions and is never a target, so it changes nothing."""
    position_ids = rows["position_ids"]
    extra = _padding(position_ids.shape[1], dims)
    position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1 + torch.arange(extra)], dim=1)
    document = (position_ids == 0).cumsum(dim=1)  # positions restart at 0 with every packed document
    chunk = position_ids.shape[1] // (2 * dims.cp)
    mine = _chunks(dims.cp, dims.cp_rank, chunk)
    keys = torch.cat([_chunks(dims.cp, r, chunk) for r in range(dims.cp)])  # the all-gather's order
    return ({"input_ids": rank_share(rows["input_ids"], dims),  # any id: never a target, never attended to
             "position_ids": position_ids[:, mine], "targets": rank_share(rows["targets"], dims, IGNORE_INDEX)},
            {"query_index": mine, "key_index": keys, "query_doc": document[:, mine], "key_doc": document[:, keys]},
            document_ends(position_ids))


def visible_keys(query_index: torch.Tensor, key_index: torch.Tensor, query_doc: torch.Tensor,
                 key_doc: torch.Tensor, window: int | None = None):
    """The mask as a flex-attention mask_mod: local query q sees gathered key k when k comes no later
    in the whole row and belongs to the same document (and, with a sliding `window`, is one of the
    `window` last tokens up to q: transformers' sliding window)."""
    def sees(b, h, q, k):
        seen = (key_index[k] <= query_index[q]) & (key_doc[b, k] == query_doc[b, q])
        return seen if window is None else seen & (query_index[q] - key_index[k] < window)
    return sees


def attention_masks(windows: tuple[int | None, ...], query_index: torch.Tensor, key_index: torch.Tensor,
                    query_doc: torch.Tensor, key_doc: torch.Tensor) -> dict[int | None, BlockMask | torch.Tensor]:
    """Which gathered keys each local query sees, for each of the model's attention `windows` (None:
    the whole row), from the layout `shard_rows` returns (on the device): flex-attention block masks
    on GPUs, the same masks as dense [rows, 1, q, k] tensors on CPU."""
    return {window: _attention_mask(visible_keys(query_index, key_index, query_doc, key_doc, window),
                                    query_index, key_index, query_doc) for window in windows}


def _attention_mask(sees, query_index: torch.Tensor, key_index: torch.Tensor,
                    query_doc: torch.Tensor) -> BlockMask | torch.Tensor:
    rows, queries, keys, device = query_doc.shape[0], query_index.shape[0], key_index.shape[0], query_doc.device
    if device.type == "cpu":
        return create_mask(sees, rows, None, queries, keys, device=device)
    return create_block_mask(sees, rows, None, queries, keys, device=device, _compile=True)


@functools.cache
def _compiled_flex_attention():
    """Flex attention runs as a fused kernel only compiled; inside a compiled block this inlines.
    Compiled like any function (dynamic after a second length), so unpacked rows of many lengths
    do not exhaust the recompile limit."""
    return torch.compile(flex_attention)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
               group_name: str, cp_masks: dict | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [rows, heads, local, dim], k/v [rows, kv heads, local,
    dim] -> ([rows, local, heads, dim], None), attending to the keys of the whole row, within the
    layer's `sliding_window`, its logits soft-capped at `softcap`, with gpt-oss's attention sinks
    (`s_aux`, a logit per head that takes its share of the softmax): keyword arguments the layers
    pass. `dropout` is always 0: models with attention dropout are refused (`cp_unsupported`)."""
    sliding_window, softcap, sinks = (kwargs.get(key) for key in ("sliding_window", "softcap", "s_aux"))
    if cp_masks is None:
        raise RuntimeError("context-parallel attention called without cp_masks (run it through sft/training/loss.py)")
    if dropout:  # a model whose config names it otherwise than attention_dropout (GPT-BigCode's attn_pdrop)
        raise ConfigError(f"cp.degree: {type(module).__name__} drops attention probabilities out, which context "
                          "parallelism does not; set its attention dropout to 0 in config.json or use cp.degree=1")
    if changed := sorted(key for key in _NOT_APPLIED if kwargs.get(key) is not None):
        raise ConfigError(f"cp.degree: {type(module).__name__} passes {', '.join(changed)} to its attention, which "
                          "context parallelism does not apply; use cp.degree=1")
    # A layer that keeps its window for a mask of transformers' own and does not pass it would attend to too much
    if sliding_window not in cp_masks or getattr(module, "sliding_window", sliding_window) != sliding_window:
        raise ConfigError(f"cp.degree: {type(module).__name__} attends within a window of {sliding_window} tokens, "
                          f"not the config's sliding_window ({[w for w in cp_masks if w]}); use cp.degree=1")
    # One collective for K and V, side by side on the last dim (multi-head latent attention's are of
    # two widths): [rows, kv heads, local, k dim + v dim] -> [..., whole row, ...] in the gather's order.
    gathered = gather_along(torch.cat([key, value], dim=-1), 2, group_name)
    key, value = gathered.split([key.shape[-1], value.shape[-1]], dim=-1)
    mask = cp_masks[sliding_window]
    if isinstance(mask, BlockMask):
        out = _flex_attention(query, key, value, mask, scaling, softcap, sinks)
    elif softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        out = _eager_attention(query, key, value, mask, scaling, softcap, sinks)
    return out.transpose(1, 2).contiguous(), None


def _soft_capped(score: torch.Tensor, b, h, q, k, cap: float) -> torch.Tensor:
    """Flex attention's score_mod for a soft cap (a partial of this function: a closure made inside a
    compiled checkpointed block lost its cap, H200, torch 2.11)."""
    return cap * torch.tanh(score / cap)


def _flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask,
                    scale: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Flex attention (GPUs), the soft cap as its score_mod; attention sinks renormalise its output
    by the log-sum-exp, as transformers' flex attention does: out x exp(lse) / (exp(lse) + exp(sink))."""
    # The kernel reads K/V in blocks of the sequence: make them contiguous.
    out = _compiled_flex_attention()(query, key.contiguous(), value.contiguous(), block_mask=mask, scale=scale,
                                     score_mod=functools.partial(_soft_capped, cap=softcap) if softcap else None,
                                     enable_gqa=True,
                                     return_aux=AuxRequest(lse=True) if sinks is not None else None)
    if sinks is None:
        return out
    out, aux = out
    return out * torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1)).unsqueeze(-1).to(out.dtype)


def _eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The same in plain operations (CPU, where SDPA takes no soft cap or sinks), as transformers'
    eager attention computes them."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column per head, which no value follows
        scores = torch.cat([scores, sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)
    return probs[..., : key.shape[2]] @ value


def attention_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """The windows the model's layers attend within (None: the whole row): one mask each per forward."""
    window = getattr(text_config(config), "sliding_window", None)
    return (None, window) if window else (None,)


def apply_context_parallel(model: PreTrainedModel, dims: ParallelDims, moe: MoE | None,
                           checkpointed_compiled: bool = False) -> None:
    """Route the model's attention through `_attention` over the mesh's cp group (before anything
    wraps or compiles the blocks). transformers then builds no mask of its own: the SFT loss passes
    `cp_masks` down to every attention call. A mixture-of-experts model's load-balancing term
    counts the whole rows, over the cp group (`moe`, the MoE handle). `checkpointed_compiled`: the
    blocks will be compiled and checkpointed."""
    reason = cp_unsupported(model)
    if reason:
        raise ConfigError(f"cp.degree={dims.cp}: {reason}; use cp.degree=1")
    if checkpointed_compiled and getattr(text_config(model.config), "attn_logit_softcapping", None):
        # Measured on 2 x H200 (torch 2.11): Gemma-2's loss 2e-5 and its gradients 1.8% away from cp 1's
        # (compiled without checkpointing, or neither, they agree to 1e-6; Gemma-3 without a soft cap too)
        raise ConfigError(f"cp.degree={dims.cp} with compile.enabled=true and ac.ratio > 0: {type(model).__name__}'s "
                          "soft-capped attention computes otherwise in compiled checkpointed blocks on GPUs; set "
                          "ac.ratio=0 or compile.enabled=false")
    AttentionInterface.register(CP_ATTENTION, functools.partial(_attention, group_name=dims.cp_group_name))
    model.config._attn_implementation = CP_ATTENTION
    if moe is not None:
        moe.count_rows_over(dims.cp_group_name)
    log0(f"applied context parallelism: each row split over {dims.cp} ranks (head-tail), K/V all-gathered")
