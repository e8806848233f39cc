"""Context parallelism: the tokens of one row split over the `cp.degree` ranks of a cp group, so a
row longer than one GPU's activations (64k-128k tokens of a reasoning trace) still trains.

Layout. Ranks are grouped in consecutive runs of cp.degree (rank = dp_rank * degree + cp_rank),
so a cp group sits inside a node. Every rank of a group reads the same rows (the data sampler sees
world / degree data-parallel ranks) and keeps its share of each: the row is cut into 2 * degree
chunks and cp rank r keeps chunks r and 2 * degree - 1 - r (head-tail), so every rank gets the
same amount of causal attention work. Positions, document boundaries and the shifted targets are
computed on the whole row before the split: hidden state t predicts label t + 1 even where t and
t + 1 land on different ranks, and a document's last token never predicts the next document's
first (its label is already ignored, sft/collate.py).

Attention. Each rank computes Q, K, V for its own tokens; K and V (small under GQA: 1/7 of the
hidden size on Qwen2.5-7B) are all-gathered over the cp group, and the rank's queries attend to
the whole row. All-gather rather than ring or head all-to-all (Ulysses): one collective per layer
whose backward is one reduce-scatter, any number of heads, and any mask. Two kernels:
* one document per row: chunk j attends to chunks 0..j-1 in full and to itself causally, two calls
  of a fused kernel without a mask (cuDNN on GPUs, the fastest causal kernel measured on H100; the
  CPU flash kernel in tests), merged by their log-sum-exp (`_HeadTailCausalAttention`);
* packed rows: a mask built from whole-row indices, causal and within one document, as a
  flex-attention block mask on GPUs (fully masked blocks, other documents and the future, cost
  nothing) and as a dense boolean mask for SDPA on CPU (flex attention has no CPU backward).

Loss. Each rank sums the cross-entropy of its own supervised tokens and divides by the global
count (sft/loss.py): every token is counted on exactly one rank, FSDP sums the gradients over all
ranks (it shards over dp x cp), and the K/V gather's backward returns each rank the gradient of its
keys and values from every query of the row. Nothing is counted twice.

Checkpoints are FSDP shards over all ranks whatever the degree, so a run resumes at another degree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention
from transformers import AttentionInterface, PreTrainedModel

from sft.config import ConfigError
from sft.distributed import DistEnv, log0
from sft.masking import IGNORE_INDEX

# Autograd-aware all-gather (backward: reduce-scatter), traceable by compile; renamed in torch 2.13.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
# The attention implementation name under which transformers calls `_attention`.
CP_ATTENTION = "sft_context_parallel"
# The keys `shard_rows` adds to a micro-batch's loss inputs, all read by `attention_mask`.
LAYOUT_KEYS = ("query_index", "key_index", "query_doc", "key_doc")


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the data-parallel x context-parallel layout; degree 1 is plain data
    parallelism (no group, rows are not split)."""
    degree: int = 1
    rank: int = 0  # in its cp group
    dp_rank: int = 0
    dp_size: int = 1
    group_name: str | None = None  # the cp group's process group

    @classmethod
    def build(cls, degree: int, env: DistEnv) -> ContextParallel:
        """Collective when degree > 1 (creates the cp groups)."""
        if env.world_size % degree:
            raise ConfigError(f"cp.degree={degree}: must divide the {env.world_size} ranks "
                              f"(e.g. cp.degree={next(d for d in (4, 2, 1) if env.world_size % d == 0)})")
        group_name = None
        if degree > 1:
            # A mesh of its own next to FSDP's: FSDP shards over all ranks (dp x cp), which is the
            # flat mesh it already has, so only the cp groups are new.
            mesh = init_device_mesh(env.device.type, (env.world_size // degree, degree), mesh_dim_names=("dp", "cp"))
            group_name = mesh["cp"].get_group().group_name
        return cls(degree, env.rank % degree, env.rank // degree, env.world_size // degree, group_name)

    def _chunks(self, cp_rank: int, chunk: int) -> torch.Tensor:
        """Whole-row indices of the tokens cp rank `cp_rank` keeps (head-tail chunks)."""
        tail = 2 * self.degree - 1 - cp_rank
        return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                          torch.arange(tail * chunk, (tail + 1) * chunk)])

    def shard_rows(self, rows: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(this rank's share of {input_ids, position_ids, targets} [rows x length], the layout
        `attention_mask` needs for packed rows; none when every row is one document). Rows are padded at the end to a multiple of 2 * degree; the padding
        continues the last document's positions and is never a target, so it changes nothing."""
        length = rows["input_ids"].shape[1]
        padded = -(-length // (2 * self.degree)) * 2 * self.degree
        extra = padded - length
        position_ids = rows["position_ids"]
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1 + torch.arange(extra)], dim=1)
        whole = {"input_ids": F.pad(rows["input_ids"], (0, extra)),  # any id: never a target, never attended to
                 "position_ids": position_ids, "targets": F.pad(rows["targets"], (0, extra), value=IGNORE_INDEX)}
        document = (position_ids == 0).cumsum(dim=1)  # positions restart at 0 with every packed document
        chunk = padded // (2 * self.degree)
        mine = self._chunks(self.rank, chunk)
        local = {k: v[:, mine] for k, v in whole.items()}
        if (document == 1).all():  # one document per row: plain causal attention, no mask to build
            return local, {}
        keys = torch.cat([self._chunks(r, chunk) for r in range(self.degree)])  # the all-gather's order
        return local, {"query_index": mine, "key_index": keys, "query_doc": document[:, mine],
                       "key_doc": document[:, keys]}


def attention_mask(query_index: torch.Tensor, key_index: torch.Tensor, query_doc: torch.Tensor,
                   key_doc: torch.Tensor) -> BlockMask | torch.Tensor:
    """Which gathered keys each local query sees (the arguments from `shard_rows`, on the device):
    a flex-attention block mask on GPUs, the same mask as a dense [rows, 1, q, k] tensor on CPU."""

    def sees(b, h, q, k):  # causal on whole-row order, within one document
        return (key_index[k] <= query_index[q]) & (key_doc[b, k] == query_doc[b, q])

    rows, queries, keys, device = query_doc.shape[0], query_index.shape[0], key_index.shape[0], query_doc.device
    if device.type == "cpu":
        return create_mask(sees, rows, None, queries, keys, device=device)
    return create_block_mask(sees, rows, None, queries, keys, device=device, _compile=True)


@functools.cache
def _compiled_flex_attention():
    """Flex attention runs as a fused kernel only compiled; inside a compiled block this inlines."""
    return torch.compile(flex_attention, dynamic=False)


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """softmax(q k^T * scale) v over one block of keys: (out, log-sum-exp per query, what its
    backward needs). cuDNN's fused kernel on GPUs (the fastest causal kernel measured on H100), the
    CPU flash kernel elsewhere; both take grouped K/V heads as they are."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _attention_block_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float | None, extra: tuple,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the output and log-sum-exp over *all* the query's blocks:
    the softmax it differentiates is then the whole row's, so the blocks' gradients simply add up
    (ring attention's backward)."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                                scale=scale)


class _HeadTailCausalAttention(torch.autograd.Function):
    """Causal attention of one cp rank's two chunks (whole-row chunks j = rank and 2 * degree - 1 -
    rank) over the row's keys in whole-row order, when every row is one document. Chunk j attends to
    chunks 0..j-1 in full and to itself causally: two fused-kernel calls of plain shapes (no mask),
    merged by their log-sum-exp."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunks: tuple[int, int],
                scale: float | None) -> torch.Tensor:
        size = query.shape[2] // 2
        outs, saved, blocks = [], [], []
        for i, j in enumerate(chunks):
            q = query[:, :, i * size : (i + 1) * size].contiguous()
            pieces = [(j * size, (j + 1) * size, True)] + ([(0, j * size, False)] if j else [])
            out = lse = None
            for start, end, causal in pieces:
                k, v = key[:, :, start:end].contiguous(), value[:, :, start:end].contiguous()
                block_out, block_lse, extra = _attention_block(q, k, v, causal, scale)
                blocks.append((i, start, end, causal, extra))
                if out is None:
                    out, lse = block_out.float(), block_lse
                else:  # the softmax over both blocks, in float32 (lse is [rows, heads, q] or [..., 1] per kernel)
                    weight = torch.sigmoid(block_lse - lse).reshape(*out.shape[:-1], 1)
                    out = out - weight * (out - block_out.float())
                    lse = lse - F.logsigmoid(lse - block_lse)
            outs.append(out.to(query.dtype).contiguous())
            saved += [q, lse]
        ctx.blocks, ctx.scale = blocks, scale
        ctx.save_for_backward(key, value, *outs, *saved)
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        key, value, *rest = ctx.saved_tensors
        outs, saved = rest[:2], rest[2:]
        size = grad.shape[2] // 2
        grad_query = [torch.zeros_like(saved[0]), torch.zeros_like(saved[2])]
        grad_key = torch.zeros(key.shape, dtype=torch.float32, device=key.device)  # summed over blocks
        grad_value = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for i, start, end, causal, extra in ctx.blocks:
            q, lse = saved[2 * i], saved[2 * i + 1]
            g = grad[:, :, i * size : (i + 1) * size].contiguous()
            k, v = key[:, :, start:end].contiguous(), value[:, :, start:end].contiguous()
            dq, dk, dv = _attention_block_backward(g, q, k, v, outs[i], lse, causal, ctx.scale, extra)
            grad_query[i] += dq
            grad_key[:, :, start:end] += dk
            grad_value[:, :, start:end] += dv
        return torch.cat(grad_query, dim=2), grad_key.to(key.dtype), grad_value.to(value.dtype), None, None


def _whole_row_order(gathered: torch.Tensor, degree: int) -> torch.Tensor:
    """K or V [rows, heads, 2 * degree chunks, dim] from the all-gather's order (rank 0's two chunks,
    rank 1's, ...) into whole-row order: chunk j is rank j's first or rank 2 * degree - 1 - j's second."""
    size = gathered.shape[2] // (2 * degree)
    slots = [2 * j if j < degree else 2 * (2 * degree - 1 - j) + 1 for j in range(2 * degree)]
    return torch.cat([gathered[:, :, s * size : (s + 1) * size] for s in slots], dim=2)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
               group_name: str, cp_rank: int, degree: int, cp_mask: BlockMask | torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [rows, heads, local, dim], k/v [rows, kv heads, local,
    dim] -> ([rows, local, heads, dim], None), attending to the keys of the whole row: causally when
    `cp_mask` is None (one document per row), else as `cp_mask` says (packed rows)."""
    if dropout:
        raise ConfigError("cp.degree > 1: attention dropout is not supported; set the model's attention_dropout to 0")
    # One collective for K and V, gathered along dim 0 (the only dim every torch version gathers
    # along without an extra copy): [local, 2, rows, kv heads, dim] -> [whole row, ...].
    local = torch.stack([key, value]).movedim(3, 0).contiguous()
    key, value = _all_gather_autograd(local, 0, group_name).movedim(0, 3).unbind(0)
    if cp_mask is None:
        out = _HeadTailCausalAttention.apply(query, _whole_row_order(key, degree), _whole_row_order(value, degree),
                                             (cp_rank, 2 * degree - 1 - cp_rank), scaling)
    elif isinstance(cp_mask, BlockMask):  # the kernel reads K/V in blocks of the sequence: make them contiguous
        out = _compiled_flex_attention()(query, key.contiguous(), value.contiguous(), block_mask=cp_mask,
                                         scale=scaling, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=cp_mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def apply_context_parallel(model: PreTrainedModel, cp: ContextParallel) -> None:
    """Route the model's attention through `_attention` over `cp`'s group (before anything wraps
    or compiles the blocks). transformers then builds no mask of its own: `_sft_loss` passes
    `cp_mask` down to every attention call."""
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if (layer_types != {"full_attention"} or getattr(config, "sliding_window", None)
            or getattr(config, "attn_logit_softcapping", None)):
        raise ConfigError(f"cp.degree={cp.degree}: {type(model).__name__} has sliding-window or soft-capped attention "
                          "layers, which context parallelism does not support; use cp.degree=1")
    AttentionInterface.register(CP_ATTENTION, functools.partial(_attention, group_name=cp.group_name,
                                                                cp_rank=cp.rank, degree=cp.degree))
    model.config._attn_implementation = CP_ATTENTION
    log0(f"applied context parallelism: each row split over {cp.degree} ranks (head-tail), K/V all-gathered")
