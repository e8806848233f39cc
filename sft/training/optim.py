"""AdamW with decoupled weight decay (not on norms/biases by default) and warmup + cosine schedule.

The state is 16 bytes per trained parameter by default: float32 master weight, gradient and two
moments (torch's fused AdamW). optim.state_dtype / optim.master_dtype = bfloat16 cut it to 12 or
8 (`LeanAdamW`): the math stays float32, and every bfloat16 write rounds stochastically (up with
the probability of the rounded-off fraction), so updates far below bfloat16's resolution (lr 1e-5
on weights of 1e-2) still move the weights on average instead of being rounded away.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from sft.config import DTYPES, OptimConfig
from sft.distributed import local_part


def apply_master_dtype(model: nn.Module, cfg: OptimConfig) -> None:
    """optim.master_dtype=bfloat16: the trained parameters in bfloat16 (on the meta device, before
    FSDP shards them, so shards, gradients and checkpoints are bfloat16)."""
    if cfg.master_dtype == "bfloat16":
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)


# Elements LeanAdamW updates at a time. Eager, each float32 temporary is then 64 MiB (the rounding
# draws' int64 ones 128 MiB), not the size of a whole shard of experts (gigabytes); compiled, each
# chunk is one kernel, large enough that launching it costs nothing next to running it.
_UPDATE_CHUNK_ELEMENTS = 1 << 24


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift, multiply, twice) on int64 values below 2^32; its
    products stay below 2^59, so nothing overflows on any device."""
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def _mix(*values: int) -> int:
    """A 32-bit key from non-negative integers (splitmix64's steps; unlike hash(), the same in every
    Python)."""
    x, mask = 0, (1 << 64) - 1
    for value in values:
        x = ((x ^ value) + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        x ^= x >> 31
    return x & 0xFFFFFFFF


def rounding_noise(key: int, start: int, numel: int, device: torch.device | str) -> torch.Tensor:
    """16 uniform random bits (int32 in [0, 2^16)) for each of `numel` elements from `start` of a
    tensor: a hash of (the element index's hash + key). A counter-based generator has no state, so a
    compiled update draws inside its one kernel, and a resumed run draws exactly what it would have.
    (The index is hashed before the key is added: keys added to plain indices would give each step
    a shifted window of one sequence, the same draws on neighbouring elements a step apart.)"""
    index = torch.arange(numel, device=device, dtype=torch.int64) + start
    return (_hash32((_hash32(index & 0xFFFFFFFF) + key) & 0xFFFFFFFF) & 0xFFFF).to(torch.int32)


def stochastic_round_(out: torch.Tensor, value: torch.Tensor, key: int, start: int = 0) -> None:
    """out (any dtype) = value (float32, flat: elements from `start` of a tensor); into bfloat16
    rounded stochastically: the 16 bits that bfloat16 drops get a draw (rounding_noise(key, start,
    ...)) added, then are truncated, so the result is the neighbour above with the probability of
    the dropped fraction (unbiased). NaN stays NaN (its bits plus the draw could carry into the sign
    or lose the payload: -0 or inf)."""
    if out.dtype != torch.bfloat16:
        out.copy_(value)
        return
    noise = rounding_noise(key, start, value.numel(), value.device).view(value.shape)
    rounded = ((value.view(torch.int32) + noise) & -65536).view(torch.float32)  # exact in bf16: low 16 bits zero
    out.copy_(torch.where(value.isnan(), value, rounded))


def _update(chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], start: int,
            keys: tuple[int, int, int], decay: float, beta1: float, beta2: float, step_size: float,
            bias_correction2_sqrt: float, eps: float) -> None:
    """One AdamW update of flat chunks (weight, gradient, both moments: elements from `start` of
    their tensors), in float32."""
    weight, grad, exp_avg, exp_avg_sq = chunks
    grad = grad.float()
    m = torch.lerp(exp_avg.float(), grad, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + grad * grad * (1 - beta2)
    stochastic_round_(exp_avg, m, keys[0], start)
    stochastic_round_(exp_avg_sq, v, keys[1], start)
    w = weight.float() * decay - step_size * m / (v.sqrt() / bias_correction2_sqrt + eps)
    stochastic_round_(weight, w, keys[2], start)


@functools.cache
def _compiled_update():
    """On a GPU (with compile.enabled) the update is one kernel (it reads and writes each tensor once and draws in
    registers) instead of ~26 launches and float32 temporaries per chunk, which left the GPU idle
    for seconds a step on the whole 30B (docs/BENCHMARKS.md). dynamic: one graph for every shard
    size and every step's scalars. The host keeps the eager update (CPU runs need no compiler)."""
    return torch.compile(_update, dynamic=True)


class LeanAdamW(torch.optim.Optimizer):
    """AdamW (torch's, decoupled weight decay) with moments in `state_dtype` and parameters of any
    dtype, computed in float32 one parameter shard at a time (DTensor shards are updated locally,
    elementwise) and written back with stochastic rounding where bfloat16. The rounding draws are a
    hash of (seed, step, rank, parameter, element): a resumed run draws exactly what it would have.
    (Not under HSDP, whose replicas would round their copies of a shard apart: sft/config/checks.py.)"""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, state_dtype: torch.dtype,
                 seed: int = 0, compiled: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.state_dtype, self.seed, self.compiled = state_dtype, seed, compiled
        self._rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # Each parameter's place in the groups (fixed once built): with the rank, what its draws are keyed on.
        self._index = {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}

    def _keys(self, step: int, param: torch.Tensor) -> tuple[int, int, int]:
        """Three keys (the two moments', the weight's) of `param`'s draws at `step`."""
        return tuple(_mix(self.seed, step, self._rank, self._index[id(param)], target) for target in range(3))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in (p for p in group["params"] if p.grad is not None):
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)  # on the host, as torch's AdamW keeps it
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
                state["step"] += 1
                step = int(state["step"])
                keys = self._keys(step, param)
                scalars = dict(decay=1 - group["lr"] * group["weight_decay"], beta1=beta1, beta2=beta2,
                               step_size=group["lr"] / (1 - beta1 ** step),
                               bias_correction2_sqrt=math.sqrt(1 - beta2 ** step), eps=group["eps"])
                tensors = [local_part(t).view(-1) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                update = _compiled_update() if self.compiled and tensors[0].is_cuda else _update
                for start in range(0, tensors[0].numel(), _UPDATE_CHUNK_ELEMENTS):
                    chunk = slice(start, start + _UPDATE_CHUNK_ELEMENTS)
                    update(tuple(t[chunk] for t in tensors), start, keys, **scalars)


def build_optimizer(model: nn.Module, cfg: OptimConfig, seed: int = 0, compiled: bool = False) -> torch.optim.Optimizer:
    """AdamW over the trained parameters; LeanAdamW where the state is bf16, its update compiled on
    GPUs with `compiled` (compile.enabled)."""
    decay, no_decay = [], []
    for param in (p for p in model.parameters() if p.requires_grad):  # frozen ones (LoRA's base) get no state
        # 1-D parameters are norm weights and biases: decaying them towards 0 only hurts.
        (decay if param.dim() >= 2 or cfg.decay_norms_and_biases else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.state_dtype != "float32" or cfg.master_dtype != "float32":
        return LeanAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, state_dtype=DTYPES[cfg.state_dtype],
                         seed=seed, compiled=compiled)
    # Fused on GPU shards and on host shards (fsdp.cpu_offload, CPU runs) alike: on the host it is
    # 3-5x faster than foreach and, unlike foreach, allocates no temporaries the size of all
    # parameters (docs/BENCHMARKS.md "Optimizer on the host").
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over optim.warmup_ratio of the steps, then half a cosine from optim.lr down to
    optim.min_lr: transformers' get_cosine_with_min_lr_schedule_with_warmup, the same arithmetic
    (its module imports transformers' trainer utilities, and they peft where it is installed: 9.6 s
    of a start-up on an H200 host)."""
    warmup, floor = math.ceil(cfg.warmup_ratio * total_steps), cfg.min_lr / optimizer.defaults["lr"]

    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total_steps - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - floor) + floor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
