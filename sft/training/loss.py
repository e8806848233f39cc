"""The SFT loss: summed token cross-entropy / supervised tokens of the whole optimizer step.

Per step, every rank counts the supervised tokens of all its micro-batches, one all-reduce makes
that the global count N, and each micro-batch backpropagates sum(CE) / N. FSDP then *sums*
gradients over ranks (divide factor 1, sft/parallel/), so the gradient is exactly that of the
token-weighted mean over the global batch, however tokens fall across micro-batches and ranks.

The lm_head and cross-entropy run only on supervised positions, in row chunks, with the
gradients computed in the same pass (`LinearCrossEntropy`): no [tokens x vocab] float32 logits
are ever stored, and the lm_head weight is gathered once per forward (it lives in the root FSDP
unit, which stays unsharded while the loss runs).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, masking_utils

from sft.config import LOGITS_PER_CHUNK
from sft.data.masking import IGNORE_INDEX
from sft.distributed import all_reduce_sum, to_device
from sft.errors import UserError
from sft.models.architecture import Logits, decoder, text_config
from sft.models.gated_deltanet import CP_ROWS, DOCUMENT_ENDS, DocumentEnds, RowParts, document_ends
from sft.models.packing import ONE_DOCUMENT_A_ROW, Packing, PackingError
from sft.models.vision import ImageInputs
from sft.parallel.context_parallel import attention_masks, attention_windows, rank_share, shard_rows
from sft.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from sft.training.model import TrainingModel

PLAIN_LOGITS = Logits()  # hidden @ lm_head.T, softmax over every row


def _chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_hidden: bool,
                           grad_weight: bool, head: Logits = PLAIN_LOGITS
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
                head: Logits = PLAIN_LOGITS) -> torch.Tensor:
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
    """The loss's arguments for a collated batch, computed on the host: which hidden states
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
    """`loss_inputs`' tensors on `device`. The document ends stay ints: the loss wants them on the
    host as well, and FSDP copies a host tensor it is handed to the GPU with a copy that waits for it."""
    return {k: to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


# transformers' attention mask builders by layer kind, for a model given masks built beforehand (Packing.masks)
MASK_BUILDERS = {"full_attention": masking_utils.create_causal_mask,
                 "sliding_attention": masking_utils.create_sliding_window_causal_mask}


def document_masks(config: PretrainedConfig, kinds: tuple[str, ...], position_ids: torch.Tensor) -> dict:
    """The attention masks of layer `kinds` for rows of `position_ids` (documents whose positions
    restart), by transformers' own builders, which find the documents there."""
    shape = torch.empty(*position_ids.shape, 0, device=position_ids.device)  # what the builders read of the input
    return {kind: MASK_BUILDERS[kind](config=config, inputs_embeds=shape, attention_mask=None, cache=None,
                                      position_ids=position_ids) for kind in kinds}


def _keeps_documents_apart(config: PretrainedConfig, kinds: tuple[str, ...]) -> bool:
    """Whether this transformers' builders keep two packed documents apart (dense masks, to look at)."""
    probe = copy.copy(config)
    probe._attn_implementation = "sdpa"
    try:
        masks = document_masks(probe, kinds, torch.tensor([[0, 1, 0, 1]]))
    except TypeError:  # builders of another signature
        return False
    return all(mask is not None and not mask[0, 0, 2, 1] and mask[0, 0, 2, 2] for mask in masks.values())


@dataclass(frozen=True)
class LossSetting:
    """What the fused loss knows of the model it runs on, decided once when it is built."""
    logits: Logits
    packing: Packing = ONE_DOCUMENT_A_ROW  # what packed rows need: document ends, masks the model does not build
    cp_group: str | None = None  # context parallelism: the process group each row is split over
    cp_windows: tuple[int | None, ...] = (None,)  # and the windows its attention layers look back within


class SFTLoss(nn.Module):
    """The fused loss of a model, `loss(**loss_inputs(batch))`: the summed cross-entropy over the
    supervised tokens. It holds the model's own children under their own names (the same
    parameters, the same names), so it is FSDP's root unit (sft/parallel/fsdp.py): FSDP gathers the
    root's parameters (embeddings, final norm, lm_head) around a forward of its root module, and this
    forward is the loss. What the loss knows of the model is its `LossSetting`.

    Packed rows' document ends reach the layers that carry state (sft/models/gated_deltanet.py);
    attention keeps documents apart by their positions (where the model does not build its masks from
    them, the loss builds them: sft/models/packing.py). Under context parallelism the layers that
    carry state run the whole rows (`RowParts`).
    """

    def __init__(self, model: PreTrainedModel, head: Logits | None = None, packing: Packing = ONE_DOCUMENT_A_ROW,
                 dims: ParallelDims | None = None):
        """`head`: what the model's head does (`Logits.of`, checked before the model was sharded);
        `packing`: what its packed rows need (`check_packing`); `dims`: the mesh, for context parallelism."""
        super().__init__()
        if own := [name for name, _ in model.named_parameters(recurse=False)]:
            # FSDP would shard them on the loss only (the model object is not among its modules)
            raise UserError(f"{type(model).__name__}: holds parameters outside its modules ({', '.join(own)}), which "
                            "the fused loss cannot hold for FSDP; this architecture is not supported")
        for name, child in model.named_children():
            self.add_module(name, child)
        self.decoder_name = decoder(model)[0]
        self.head_name = next(name for name, module in model.named_modules()
                              if module is model.get_output_embeddings())
        cp = dims is not None and dims.cp_enabled
        self.setting = LossSetting(head or Logits.of(model), packing, dims.cp_group_name if cp else None,
                                   attention_windows(model.config) if cp else (None,))
        self.text_config = text_config(model.config)  # what the attention mask builders read
        if packing.masks and not _keeps_documents_apart(self.text_config, packing.masks):
            raise PackingError(f"data.packing=true: {type(model).__name__} builds its attention masks without the "
                               "position ids, and this transformers' mask builders do not keep packed documents apart "
                               "either; set data.packing=false")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, target_rows: torch.Tensor,
                target_ids: torch.Tensor, document_ends: tuple[int, ...] | None = None,
                images: ImageInputs | None = None, **cp_layout: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy over the supervised tokens (arguments from `loss_inputs`; a
        micro-batch's `images` from `image_inputs`)."""
        setting, ends = self.setting, None
        if document_ends is not None and setting.packing.document_ends:
            on_host = torch.tensor(document_ends)
            ends = DocumentEnds(on_host, to_device(on_host, input_ids.device))
        if cp_layout:
            extra = {"cp_masks": attention_masks(setting.cp_windows, **cp_layout),
                     CP_ROWS: RowParts(setting.cp_group, cp_layout["key_index"].argsort(), cp_layout["query_index"],
                                       ends)}
        else:
            extra = {DOCUMENT_ENDS: ends} if ends is not None else {}
            if document_ends is not None and setting.packing.masks:
                extra["attention_mask"] = document_masks(self.text_config, setting.packing.masks, position_ids)
        decoder = self.get_submodule(self.decoder_name)
        inputs = {"input_ids": input_ids, "position_ids": position_ids} if images is None else \
            images.decoder_inputs(decoder.get_input_embeddings(), input_ids)
        hidden = decoder(**inputs, use_cache=False, **extra).last_hidden_state
        weight = self.get_submodule(self.head_name).weight
        if setting.logits.vocab is not None:
            weight = weight[: setting.logits.vocab]
        args = (hidden.flatten(0, 1).index_select(0, target_rows), weight, target_ids)
        if torch.is_grad_enabled():
            return LinearCrossEntropy.apply(*args, setting.logits)
        return _chunked_cross_entropy(*args, grad_hidden=False, grad_weight=False, head=setting.logits)[0]


def image_inputs(built: TrainingModel, batch: dict) -> ImageInputs | None:
    """A micro-batch's images as the language model takes them (sft/models/vision.py), None without."""
    if "images" not in batch:
        return None
    pixels = built.images.pixels(batch["images"])
    return built.vision.inputs(built.vision.host_inputs(batch["input_ids"], batch["position_ids"], pixels))


def forward_backward(built: TrainingModel, micro_batches: list[dict[str, torch.Tensor]], device: torch.device,
                     sync_each_microbatch: bool = True, dims: ParallelDims | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate one optimizer step's gradients; return (this rank's CE sum, global supervised
    token count), both still on the device: nothing here makes the host wait for the GPU. A
    mixture-of-experts model's load-balancing term (its MoE handle, sft/models/moe.py) joins the
    loss inside its blocks."""
    moe = built.moe
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
            built.loss.set_requires_gradient_sync(i == len(inputs) - 1)
        if moe:
            moe.begin_micro_batch(to_device(real[i], device))
        loss = built.loss(**on_device(batch, device), images=image_inputs(built, micro_batches[i]))
        if moe:
            moe.end_micro_batch()  # before backward, which may recompute the blocks
        (loss / num_tokens).backward()
        ce_sum += loss.detach()
    return ce_sum, num_tokens
