"""AdamW with decoupled weight decay (not on norms/biases by default) and warmup + cosine schedule.

The state is 16 bytes per trained parameter by default: float32 master weight, gradient and two
moments (torch's fused AdamW). optim.state_dtype / optim.master_dtype = bfloat16 cut it to 12 or
8 (`LeanAdamW`): the math stays float32, and every bfloat16 write rounds stochastically (up with
the probability of the rounded-off fraction), so updates far below bfloat16's resolution (lr 1e-5
on weights of 1e-2) still move the weights on average instead of being rounded away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from sft.config import DTYPES, OptimConfig
from sft.distributed import local_part


@dataclass(frozen=True)
class StateBytes:
    """Bytes per trained parameter of each part of the training state; the planner, the checkpoint
    size warnings and the host staging all count with these."""
    master: int = 4
    """the master weight (float32; bf16 with optim.master_dtype)"""
    grad: int = 4
    """its gradient, from backward to the optimizer step (in the master's dtype)"""
    optimizer: int = 8
    """AdamW's two moments (float32; bf16 with optim.state_dtype)"""

    @property
    def checkpoint(self) -> int:
        """What a checkpoint holds of it: the weight and the optimizer state."""
        return self.master + self.optimizer

    @property
    def total(self) -> int:
        return self.master + self.grad + self.optimizer


STATE_BYTES = StateBytes()


def state_bytes(cfg: OptimConfig) -> StateBytes:
    """The state a trained parameter costs under `cfg` (the gradient has the master's dtype: FSDP
    casts the reduced gradient to it)."""
    master = 2 if cfg.master_dtype == "bfloat16" else 4
    return StateBytes(master=master, grad=master, optimizer=2 * (2 if cfg.state_dtype == "bfloat16" else 4))


def apply_master_dtype(model: nn.Module, cfg: OptimConfig) -> None:
    """optim.master_dtype=bfloat16: the trained parameters in bfloat16 (on the meta device, before
    FSDP shards them, so shards, gradients and checkpoints are bfloat16)."""
    if cfg.master_dtype == "bfloat16":
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)


# Elements LeanAdamW updates at a time: 256 MiB per float32 temporary (a whole shard of experts'
# would take GBs), few enough launches not to leave the GPU waiting on Python.
_UPDATE_CHUNK_ELEMENTS = 1 << 26


def stochastic_round_(out: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None) -> None:
    """out (any dtype) = value (float32); into bfloat16 rounded stochastically: the 16 bits that
    bfloat16 drops are replaced by a uniform draw added to them, then truncated, so the result is
    the neighbour above with the probability of the dropped fraction (unbiased). NaN stays NaN
    (its bits plus the draw could carry into the sign or lose the payload: -0 or inf)."""
    if out.dtype != torch.bfloat16:
        out.copy_(value)
        return
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << 16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    rounded = ((bits + noise) & -65536).view(torch.float32)  # exact in bf16: the low 16 bits are zero
    out.copy_(torch.where(value.isnan(), value, rounded))


class LeanAdamW(torch.optim.Optimizer):
    """AdamW (torch's, decoupled weight decay) with moments in `state_dtype` and parameters of any
    dtype, computed in float32 one parameter shard at a time (DTensor shards are updated locally,
    elementwise) and written back with stochastic rounding where bfloat16. The rounding draws come
    from a generator seeded by (seed, step, rank): a resumed run draws exactly what it would have.
    (Not under HSDP, whose replicas would round their copies of a shard apart: sft/config/checks.py.)"""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, state_dtype: torch.dtype,
                 seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.state_dtype, self.seed = state_dtype, seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, step: int) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return self._generators[device].manual_seed((self.seed * 1_000_003 + step) * 65_537 + rank)

    @torch.no_grad()
    def step(self, closure=None):
        generators: dict[torch.device, torch.Generator] = {}
        for group in self.param_groups:
            for param in (p for p in group["params"] if p.grad is not None):
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)  # on the host, as torch's AdamW keeps it
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
                state["step"] += 1
                step = int(state["step"])
                tensors = [local_part(t).view(-1) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                if tensors[0].device not in generators:
                    generators[tensors[0].device] = self._generator(tensors[0].device, step)
                # In chunks: the float32 temporaries of a whole shard of experts would be gigabytes.
                for start in range(0, tensors[0].numel(), _UPDATE_CHUNK_ELEMENTS):
                    chunk = slice(start, start + _UPDATE_CHUNK_ELEMENTS)
                    self._update(*(t[chunk] for t in tensors), group, step, generators[tensors[0].device])

    @staticmethod
    def _update(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                group: dict, step: int, generator: torch.Generator) -> None:
        beta1, beta2 = group["betas"]
        grad = grad.float()
        # float32 views of float32 state are the state itself: updated in place, never sqrt_'d
        m = exp_avg.float().lerp_(grad, 1 - beta1)
        v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        stochastic_round_(exp_avg, m, generator)
        stochastic_round_(exp_avg_sq, v, generator)
        w = weight.float().mul_(1 - group["lr"] * group["weight_decay"])
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        w.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1 ** step))
        stochastic_round_(weight, w, generator)


def build_optimizer(model: nn.Module, cfg: OptimConfig, seed: int = 0) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for param in (p for p in model.parameters() if p.requires_grad):  # frozen ones (LoRA's base) get no state
        # 1-D parameters are norm weights and biases: decaying them towards 0 only hurts.
        (decay if param.dim() >= 2 or cfg.decay_norms_and_biases else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.state_dtype != "float32" or cfg.master_dtype != "float32":
        return LeanAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, state_dtype=DTYPES[cfg.state_dtype], seed=seed)
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
    if not groups:
        return torch.zeros(())
    for params in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if max_norm:
        for params in groups:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
