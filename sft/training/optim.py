"""AdamW with decoupled weight decay (not on norms/biases by default) and warmup + cosine schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from sft.config import OptimConfig


@dataclass(frozen=True)
class StateBytes:
    """Bytes per trained parameter of each part of the training state; the planner, the checkpoint
    size warnings and the host staging all count with these."""
    master: int = 4
    """the float32 master weight"""
    grad: int = 4
    """its float32 gradient, from backward to the optimizer step"""
    optimizer: int = 8
    """AdamW's two float32 moments"""

    @property
    def checkpoint(self) -> int:
        """What a checkpoint holds of it: the weight and the optimizer state."""
        return self.master + self.optimizer

    @property
    def total(self) -> int:
        return self.master + self.grad + self.optimizer


STATE_BYTES = StateBytes()


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in (p for p in model.parameters() if p.requires_grad):  # frozen ones (LoRA's base) get no state
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
    before clipping as a plain tensor. The gradients of each mesh give one norm (DTensor norms take
    one mesh at a time, and under expert parallelism the experts live on a mesh of their own), each
    reduced over its ranks; the global norm is their norm."""
    by_mesh: dict = {}
    for param in (p for p in model.parameters() if p.grad is not None):
        by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
    groups, norms = list(by_mesh.values()), []
    for params in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if max_norm:
        for params in groups:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
