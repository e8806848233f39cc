"""AdamW with decoupled weight decay (not on norms/biases by default) and warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from sft.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        # 1-D parameters are norm weights and biases: decaying them towards 0 only hurts.
        (decay if param.dim() >= 2 or cfg.decay_norms_and_biases else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused on GPU shards and on host shards (fsdp.cpu_offload, CPU runs) alike: on the host it is
    # 3-5x faster than foreach and, unlike foreach, allocates no temporaries the size of all
    # parameters (docs/BENCHMARKS.md "Optimizer on the host").
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=math.ceil(cfg.warmup_ratio * total_steps),
        num_training_steps=total_steps, min_lr=cfg.min_lr)


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip the global gradient norm to `max_norm` (None: only measure it); return the norm
    before clipping as a plain tensor (FSDP2 gradients give a DTensor)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
