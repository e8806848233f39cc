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
they are); the load-balancing term counts the whole rows (sft/models/moe.py).

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
from torch.distributed import _functional_collectives as funcol
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention
from transformers import AttentionInterface, PreTrainedModel

from sft.config import ConfigError
from sft.data.masking import IGNORE_INDEX
from sft.distributed import log0
from sft.models.packing import cp_unsupported
from sft.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from sft.models.moe import MoE

# Autograd-aware all-gather (backward: reduce-scatter), traceable by compile; renamed in torch 2.13.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
# The attention implementation name under which transformers calls `_attention`.
CP_ATTENTION = "sft_context_parallel"
# What an attention layer may pass that changes its result and `_attention` does not apply (attention
# sinks, a soft cap, a window): a layer that passes one is refused (cp_unsupported refuses the
# models whose config says so before anything is built; this catches the rest).
_NOT_APPLIED = ("s_aux", "sinks", "softcap", "sliding_window")


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


def shard_rows(rows: dict[str, torch.Tensor],
               dims: ParallelDims) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(this rank's share of {input_ids, position_ids, targets} [rows x length], the layout
    `attention_mask` needs). Rows are padded at the end to a multiple of 2 * cp; the padding
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
            {"query_index": mine, "key_index": keys, "query_doc": document[:, mine], "key_doc": document[:, keys]})


def visible_keys(query_index: torch.Tensor, key_index: torch.Tensor, query_doc: torch.Tensor,
                 key_doc: torch.Tensor):
    """The mask as a flex-attention mask_mod: local query q sees gathered key k when k comes no later
    in the whole row and belongs to the same document."""
    def sees(b, h, q, k):
        return (key_index[k] <= query_index[q]) & (key_doc[b, k] == query_doc[b, q])
    return sees


def attention_mask(query_index: torch.Tensor, key_index: torch.Tensor, query_doc: torch.Tensor,
                   key_doc: torch.Tensor) -> BlockMask | torch.Tensor:
    """Which gathered keys each local query sees (the arguments from `shard_rows`, on the device):
    a flex-attention block mask on GPUs, the same mask as a dense [rows, 1, q, k] tensor on CPU."""
    sees = visible_keys(query_index, key_index, query_doc, key_doc)
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
               group_name: str, cp_mask: BlockMask | torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [rows, heads, local, dim], k/v [rows, kv heads, local,
    dim] -> ([rows, local, heads, dim], None), attending to the keys of the whole row. `dropout` is
    always 0: models with attention dropout are refused (`cp_unsupported`)."""
    if cp_mask is None:
        raise RuntimeError("context-parallel attention called without cp_mask (use model.sft_loss)")
    if changed := sorted(key for key in _NOT_APPLIED if kwargs.get(key) is not None):
        raise ConfigError(f"cp.degree: {type(module).__name__} passes {', '.join(changed)} to its attention, which "
                          "context parallelism does not apply; use cp.degree=1")
    # One collective for K and V, side by side on the last dim (multi-head latent attention's are of
    # two widths), gathered along dim 0 (the only dim every torch version gathers along without an
    # extra copy): [local, rows, kv heads, k dim + v dim] -> [whole row, ...].
    local = torch.cat([key, value], dim=-1).movedim(2, 0).contiguous()
    key, value = _all_gather_autograd(local, 0, group_name).movedim(0, 2).split(
        [key.shape[-1], value.shape[-1]], dim=-1)
    if isinstance(cp_mask, BlockMask):  # the kernel reads K/V in blocks of the sequence: make them contiguous
        out = _compiled_flex_attention()(query, key.contiguous(), value.contiguous(), block_mask=cp_mask,
                                         scale=scaling, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=cp_mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def apply_context_parallel(model: PreTrainedModel, dims: ParallelDims, moe: MoE | None) -> None:
    """Route the model's attention through `_attention` over the mesh's cp group (before anything
    wraps or compiles the blocks). transformers then builds no mask of its own: `sft_loss` passes
    `cp_mask` down to every attention call. A mixture-of-experts model's load-balancing term
    counts the whole rows, over the cp group (`moe`, the MoE handle)."""
    reason = cp_unsupported(model)
    if reason:
        raise ConfigError(f"cp.degree={dims.cp}: {reason}; use cp.degree=1")
    AttentionInterface.register(CP_ATTENTION, functools.partial(_attention, group_name=dims.cp_group_name))
    model.config._attn_implementation = CP_ATTENTION
    if moe is not None:
        moe.count_rows_over(dims.cp_group_name)
    log0(f"applied context parallelism: each row split over {dims.cp} ranks (head-tail), K/V all-gathered")
