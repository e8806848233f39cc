"""The model as a run trains it, built in the fixed order: transformers' architecture on the meta
device -> causal SDPA where every row is one sequence -> our MoE blocks -> LoRA adapters -> the
master weights' dtype -> the fused loss, which holds the model's children (FSDP's root unit) ->
parallelize (context and expert parallelism, float8, activation checkpointing, compile, FSDP2:
sft/parallel/parallelize.py) -> materialised shard by shard, so no rank ever holds the full
weights. The weights come after (Checkpointer.restore).

train.py and the distributed tests' worker both build it here, so the tested recipe is the trained one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from sft.adapters.lora import LoRA, apply_lora
from sft.config import DTYPES, Config, ConfigError
from sft.data.images import ImageTokens
from sft.distributed import log0, rank0_first
from sft.hub.weights import SafetensorsWeights
from sft.models.architecture import Logits, decoder_blocks
from sft.models.build import build_meta_model, materialize, model_config, real_buffers, use_causal_sdpa
from sft.models.gated_deltanet import use_gated_deltanet_kernels
from sft.models.moe import MoE, apply_moe
from sft.models.packing import check_packing
from sft.models.vision import VisionTower
from sft.parallel.mesh import ParallelDims
from sft.parallel.parallelize import parallelize
from sft.training.loss import SFTLoss
from sft.training.optim import apply_master_dtype


@dataclass
class TrainingModel:
    model: PreTrainedModel  # sharded, materialised, its weights not yet loaded
    moe: MoE | None  # the MoE handle (sft/models/moe.py); None for a dense model
    lora: LoRA | None  # the LoRA handle (sft/adapters/lora.py); None without LoRA
    loss: SFTLoss  # loss(**loss_inputs(batch)): the summed cross-entropy; FSDP's root unit (sft/training/loss.py)
    images: ImageTokens | None = None  # for data with images: the image processor (sft/data/images.py)
    vision: VisionTower | None = None  # and the frozen vision tower (sft/models/vision.py)


def build_training_model(cfg: Config, dims: ParallelDims, device: torch.device,
                         images: ImageTokens | None = None) -> TrainingModel:
    """Collective: the model of `cfg`, parallelized over the mesh of `dims` and materialised on `device`;
    with `images` (the data holds some), its vision tower beside it."""
    if images is not None and dims.cp_enabled:
        raise ConfigError(f"cp.degree={dims.cp}: the data holds images, whose rows are not split over ranks yet; "
                          "set cp.degree=1")
    if images is not None and cfg.model.init == "random":
        raise ConfigError("model.init=random: the data holds images, and the vision tower trains frozen from the "
                          "checkpoint's weights; write random ones (scripts/save_random_checkpoint.py) and load them "
                          "with model.init=pretrained")
    model = rank0_first(lambda: build_meta_model(cfg.model))
    head = rank0_first(lambda: Logits.of(model))  # the fused lm_head + cross-entropy computes it, or one line
    # Packed documents kept apart (layers that carry state restart, masks the model does not build from
    # the positions are built), or one line before anything is allocated
    packing = rank0_first(lambda: check_packing(model, cfg.data.packing))
    rank0_first(lambda: use_gated_deltanet_kernels(model, device))  # fla's kernels on GPUs, or one line
    if (attention := model.config._attn_implementation) != cfg.model.attn_implementation:
        log0(f"attention: {type(model).__name__} cannot run model.attn_implementation={cfg.model.attn_implementation} "
             f"here; using {attention} (model.attn_implementation chooses)")
    if use_causal_sdpa(model, cfg.data.packing):  # rows of one sequence: no mask, no wait for the GPU to build one
        log0("attention: causal SDPA, no mask (rows of one sequence)")
    # MoE models: our routing, experts and load-balancing loss (rank 0 first: one error)
    moe = rank0_first(lambda: apply_moe(model, cfg.moe))
    if moe:
        log0(moe.path)
    blocks = decoder_blocks(model)  # LoRA replaces layers inside the blocks, never the blocks
    # LoRA: adapters on the blocks' Linear layers, everything else frozen in the compute dtype
    lora = apply_lora(model, blocks, cfg.lora, DTYPES[cfg.fsdp.param_dtype])
    if lora:
        log0(lora.summary)
    apply_master_dtype(model, cfg.optim)  # optim.master_dtype=bfloat16: the trained weights in bf16
    buffers = real_buffers(model)
    # the fused lm_head + cross-entropy, holding the model's children: FSDP's root unit
    loss = rank0_first(lambda: SFTLoss(model, head, packing, dims))  # or one line
    parallelize(model, blocks, dims, cfg.ac, cfg.compile.enabled, cfg.fsdp, cfg.precision.float8, moe, lora, loss)
    # nothing may have swapped a child of the model since: the loss would run the old one
    assert dict(loss.named_children()) == dict(model.named_children()), "the loss no longer holds the model's children"
    materialize(model, buffers, device, offload=cfg.fsdp.cpu_offload)
    model.train()
    # the frozen vision tower and projector, read from the files as transformers converts them
    vision = rank0_first(lambda: VisionTower(
        model_config(cfg.model), SafetensorsWeights(cfg.model.name_or_path, model).read_outside_language_model, device,
        DTYPES[cfg.fsdp.param_dtype])) if images else None
    return TrainingModel(model, moe, lora, loss, images, vision)
