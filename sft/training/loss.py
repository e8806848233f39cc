"""The SFT loss: summed token cross-entropy / supervised tokens of the whole optimizer step.

Per step, every rank counts the supervised tokens of all its micro-batches, one all-reduce makes
that the global count N, and each micro-batch backpropagates sum(CE) / N. FSDP then *sums*
gradients over ranks (divide factor 1, sft/parallel/), so the gradient is exactly that of the
token-weighted mean over the global batch, however tokens fall across micro-batches and ranks.

The lm_head and cross-entropy run only on supervised positions, in row chunks, with the
gradients computed in the same pass (`LinearCrossEntropy`): no [tokens x vocab] float32 logits
are ever stored, and the lm_head weight is gathered once per forward (it lives in the root FSDP
unit, which stays unsharded while `sft_loss` runs).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method
from transformers import PreTrainedModel

from sft.config import LOGITS_PER_CHUNK
from sft.data.masking import IGNORE_INDEX
from sft.distributed import all_reduce_sum, to_device
from sft.models.build import ModelError, decoder
from sft.models.gated_deltanet import CP_ROWS, DOCUMENT_ENDS, DocumentEnds, RowParts, document_ends
from sft.parallel.context_parallel import attention_masks, rank_share, shard_rows
from sft.parallel.mesh import ParallelDims



@dataclass(frozen=True)
class Logits:
    """What a model's head does to hidden @ lm_head.T before the softmax (transformers' forward of
    its causal-LM class): a scale (Cohere's logit_scale; Granite's and MiniCPM3's 1 / logits_scaling;
    Falcon-H1's lm_head_multiplier; Inkling's 1 / logits_mup_width_multiplier), Gemma-2's soft cap,
    cap * tanh(logits / cap), and the logits the softmax runs over (Inkling's unpadded_vocab_size:
    the first `vocab` rows of lm_head; None: all)."""
    scale: float = 1.0
    cap: float | None = None
    vocab: int | None = None

    @classmethod
    def of(cls, config) -> Logits:
        text = config.get_text_config()

        def key(name: str, default):
            value = getattr(text, name, None)
            return default if value is None else value
        return cls(key("logit_scale", 1.0) * key("lm_head_multiplier", 1.0) * key("output_multiplier", 1.0)
                   / key("logits_scaling", 1.0) / key("logits_mup_width_multiplier", 1.0),
                   key("final_logit_softcapping", None) or None, key("unpadded_vocab_size", None))


def _chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_hidden: bool,
                           grad_weight: bool, head: Logits = Logits()
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """sum_i CE(head(hidden_i @ weight.T), target_i) in row chunks, and the gradients asked for (a
    frozen lm_head, LoRA's, needs none: neither its float32 buffer nor the matmul that fills it)."""
    chunk = max(1, LOGITS_PER_CHUNK // weight.shape[0])
    acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax and sums in >= fp32
    total = torch.zeros((), dtype=acc, device=hidden.device)
    d_hidden = torch.empty_like(hidden) if grad_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if grad_weight else None
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        logits = (h @ weight.T).to(acc)
        if head.scale != 1.0:
            logits.mul_(head.scale)
        if head.cap:
            capped = torch.tanh(logits / head.cap)
            logits = capped * head.cap
        lse = torch.logsumexp(logits, dim=-1)
        total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
        if grad_hidden or grad_weight:
            # d CE / d logits = softmax - onehot, then back through the cap and the scale
            grad_logits = torch.exp_(logits.sub_(lse[:, None]))
            grad_logits[torch.arange(t.shape[0], device=t.device), t] -= 1.0
            if head.cap:
                grad_logits.mul_(1 - capped.square_())
            if head.scale != 1.0:
                grad_logits.mul_(head.scale)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden:
                d_hidden[start : start + chunk] = grad_logits @ weight
            if grad_weight:
                d_weight += grad_logits.T @ h
    return total, d_hidden, d_weight


class LinearCrossEntropy(torch.autograd.Function):
    """Autograd wrapper: the gradients are formed during forward, chunk by chunk, and replayed."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                head: Logits = Logits()) -> torch.Tensor:
        total, grad_hidden, grad_weight = _chunked_cross_entropy(hidden, weight, targets, *ctx.needs_input_grad[:2],
                                                                 head)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden * grad_total.to(grad_hidden.dtype),
                None if grad_weight is None else grad_weight * grad_total.to(grad_weight.dtype), None, None)


def loss_inputs(batch: dict[str, torch.Tensor], dims: ParallelDims | None = None
                ) -> dict[str, torch.Tensor | tuple[int, ...]]:
    """`sft_loss`'s arguments for a collated batch, computed on the host: which hidden states
    predict a supervised token (rows of the flattened [batch x seq] hidden states) and that token;
    with context parallelism (`dims`), for this rank's share of each row, plus the attention layout;
    for packed rows, the documents' ends (ints).

    Selecting them with a boolean mask on the GPU would make the host wait for the forward pass
    every micro-batch (the result's size depends on the data); on the host it costs nothing.
    """
    # Hidden state t predicts label t + 1 (labels unshifted); the last one predicts nothing.
    rows = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
            "targets": F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)}
    layout = {}
    if dims is not None and dims.cp_enabled:
        rows, layout, ends = shard_rows(rows, dims)  # targets shifted on the whole row, then split
    else:
        ends = document_ends(rows["position_ids"])
    if ends is not None:  # packed: for layers that carry state (under cp: the whole rows' ends)
        layout["document_ends"] = tuple(ends.tolist())  # ints: see on_device
    targets = rows["targets"]
    sample, position = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    return {"input_ids": rows["input_ids"], "position_ids": rows["position_ids"],
            "target_rows": sample * targets.shape[1] + position, "target_ids": targets[sample, position], **layout}


def on_device(inputs: dict[str, torch.Tensor | tuple[int, ...]], device: torch.device
              ) -> dict[str, torch.Tensor | tuple[int, ...]]:
    """`loss_inputs`' tensors on `device`. The document ends stay ints: `sft_loss` wants them on the
    host as well, and FSDP copies a host tensor it is handed to the GPU with a copy that waits for it."""
    return {k: to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _sft_loss(self: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, target_rows: torch.Tensor,
              target_ids: torch.Tensor, document_ends: tuple[int, ...] | None = None,
              **cp_layout: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the supervised tokens (arguments from `loss_inputs`). Packed rows'
    document ends reach the layers that carry state (sft/models/gated_deltanet.py); attention
    keeps documents apart by their positions. Under context parallelism the layers that carry state
    run the whole rows (`RowParts`)."""
    ends = None
    if document_ends is not None and getattr(self, "sft_document_ends", False):  # layers that restart per document
        on_host = torch.tensor(document_ends)
        ends = DocumentEnds(on_host, to_device(on_host, input_ids.device))
    if cp_layout:
        extra = {"cp_masks": attention_masks(self.sft_cp_windows, **cp_layout),
                 CP_ROWS: RowParts(self.sft_cp_group, cp_layout["key_index"].argsort(), cp_layout["query_index"], ends)}
    else:
        extra = {DOCUMENT_ENDS: ends} if ends is not None else {}
    hidden = decoder(self)[1](input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                **extra).last_hidden_state
    weight = self.get_output_embeddings().weight
    if self.sft_logits.vocab is not None:
        weight = weight[: self.sft_logits.vocab]
    args = (hidden.flatten(0, 1).index_select(0, target_rows), weight, target_ids)
    if torch.is_grad_enabled():
        return LinearCrossEntropy.apply(*args, self.sft_logits)
    return _chunked_cross_entropy(*args, grad_hidden=False, grad_weight=False, head=self.sft_logits)[0]


def attach_sft_loss(model: PreTrainedModel) -> None:
    """Give the (FSDP-sharded) model an `sft_loss(**loss_inputs(batch))` method.

    Registered as an FSDP forward method so the root unit's parameters (embeddings, final norm,
    lm_head) are gathered around it exactly as around `forward`.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ModelError(f"{type(model).__name__}: the output layer is not a bias-free Linear, which the fused "
                         "lm_head + cross-entropy needs; this architecture is not supported")
    text = model.config.get_text_config()
    if getattr(text, "logits_soft_cap", None) or "final_logits_bias" in dict(model.named_buffers()):
        raise ModelError(f"{type(model).__name__}: its head post-processes logits in a way the fused lm_head + "
                         "cross-entropy does not (a logits_soft_cap or a final_logits_bias); this architecture is "
                         "not supported")
    model.sft_logits = Logits.of(model.config)  # its scale and soft cap, which the fused loss applies
    model.sft_loss = types.MethodType(_sft_loss, model)
    register_fsdp_forward_method(model, "sft_loss")


def forward_backward(model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], device: torch.device,
                     sync_each_microbatch: bool = True, dims: ParallelDims | None = None, moe=None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate one optimizer step's gradients; return (this rank's CE sum, global supervised
    token count), both still on the device: nothing here makes the host wait for the GPU. `moe`:
    the MoE handle of a mixture-of-experts model (sft/models/moe.py), whose load-balancing term joins
    the loss inside its blocks."""
    inputs = [loss_inputs(b, dims) for b in micro_batches]
    # The real tokens of this rank's rows (for MoE), of its share of them under context parallelism.
    real = [rank_share(b["real_tokens"].float(), dims) if dims is not None and dims.cp_enabled else b["real_tokens"]
            for b in micro_batches] if moe else []
    # One all-reduce of the count before any backward: every micro-batch on every rank is
    # divided by the same global number of supervised tokens (and, for MoE, of real tokens).
    counts = [sum(len(x["target_ids"]) for x in inputs)]
    if moe:
        counts.append(sum(int(r.sum()) for r in real))
    counts = all_reduce_sum(counts, device)
    num_tokens = counts[0]
    if moe:
        moe.begin_step(counts[1])
    ce_sum = torch.zeros((), dtype=torch.float32, device=device)
    for i, batch in enumerate(inputs):
        if not sync_each_microbatch:  # FSDP2's no_sync: reduce only after the last micro-batch
            model.set_requires_gradient_sync(i == len(inputs) - 1)
        if moe:
            moe.begin_micro_batch(to_device(real[i], device))
        loss = model.sft_loss(**on_device(batch, device))
        if moe:
            moe.end_micro_batch()  # before backward, which may recompute the blocks
        (loss / num_tokens).backward()
        ce_sum += loss.detach()
    return ce_sum, num_tokens
