"""AdamW parameter groups and the warmup + cosine schedule, against their definitions."""

import math

import pytest
import torch

from helpers import DEMO_MODEL
from sft.config import ModelConfig, OptimConfig, state_bytes
from sft.models.build import build_meta_model
from sft.training.optim import (LeanAdamW, build_optimizer, build_scheduler, rounding_noise,
                                stochastic_round_)


@pytest.fixture(scope="module")
def model():
    return build_meta_model(ModelConfig(name_or_path=str(DEMO_MODEL))).to_empty(device="cpu")


@pytest.mark.parametrize("decay_norms_and_biases", [False, True])
def test_weight_decay_skips_norms_and_biases_unless_asked(model, decay_norms_and_biases):
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1, decay_norms_and_biases=decay_norms_and_biases))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    undecayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    one_dim = {n for n, p in model.named_parameters() if p.dim() == 1}
    assert decayed | undecayed == set(names.values()) and not decayed & undecayed
    assert one_dim and any(n.endswith("norm.weight") for n in one_dim)
    assert undecayed == (set() if decay_norms_and_biases else one_dim)


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_ratio=0.1)
    optimizer = build_optimizer(torch.nn.Linear(1, 1), cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps=100)
    lrs = []
    for _ in range(100):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    warmup = 10  # ceil(0.1 * 100)
    for step, lr in enumerate(lrs):
        if step < warmup:
            expected = 1e-3 * step / warmup
        else:
            progress = (step - warmup) / (100 - warmup)
            expected = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))
        assert lr == pytest.approx(expected, rel=1e-9, abs=1e-12), step
    assert lrs[warmup] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4, rel=0.01)
    # transformers' schedule, which it replaces (its module imports peft): the same numbers, and its state loads
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    theirs = get_cosine_with_min_lr_schedule_with_warmup(build_optimizer(torch.nn.Linear(1, 1), cfg), 10, 100,
                                                          min_lr=1e-4)
    assert [theirs.lr_lambdas[0](step) for step in range(102)] == [scheduler.lr_lambdas[0](step) for step in range(102)]
    scheduler.load_state_dict(theirs.state_dict())


def _adamw_steps(optimizer_of, steps: int = 5) -> list[torch.Tensor]:
    """Parameters after `steps` AdamW steps on fixed gradients (weight decay on the matrix)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    grads = [[torch.randn_like(p) for p in params] for _ in range(steps)]
    optimizer = optimizer_of([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}])
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_lean_adamw_is_torch_s_adamw():
    """With float32 moments and weights, LeanAdamW's math is torch's AdamW (to float32 rounding)."""
    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours = _adamw_steps(lambda groups: LeanAdamW(groups, state_dtype=torch.float32, **options))
    torch_s = _adamw_steps(lambda groups: torch.optim.AdamW(groups, **options))
    for a, b in zip(ours, torch_s):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bf16_moments_stay_close_to_float32_ones():
    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    lean = _adamw_steps(lambda groups: LeanAdamW(groups, state_dtype=torch.bfloat16, **options), steps=20)
    exact = _adamw_steps(lambda groups: torch.optim.AdamW(groups, **options), steps=20)
    for a, b in zip(lean, exact):
        assert (a - b).abs().max() < 2e-3  # 20 steps of lr 1e-2: the weights moved by up to 0.2


def test_stochastic_rounding_keeps_updates_below_bf16_resolution():
    """1000 updates of +1e-4 to weights of 1.0 (bf16's spacing there: 2^-7 = 0.0078): rounded to
    nearest every update is lost; rounded stochastically the mean weight reaches 1.1 (unbiased)."""
    weights, nearest = torch.ones(10_000, dtype=torch.bfloat16), torch.ones(10_000, dtype=torch.bfloat16)
    for step in range(1000):
        stochastic_round_(weights, weights.float() + 1e-4, key=step)
        nearest.copy_(nearest.float() + 1e-4)
    assert torch.equal(nearest, torch.ones_like(nearest))
    assert weights.float().mean().item() == pytest.approx(1.1, abs=2e-3)
    negative = torch.full((10_000,), -1.0, dtype=torch.bfloat16)
    for step in range(1000):
        stochastic_round_(negative, negative.float() - 1e-4, key=7919 * step)
    assert negative.float().mean().item() == pytest.approx(-1.1, abs=2e-3)


def test_stochastic_rounding_keeps_special_values_and_float32_targets():
    """NaN (also CUDA's 0x7FFFFFFF, whose bits plus a draw would carry into the sign), infinities
    and zeros come out as they went in; a float32 target takes the value exactly."""
    cuda_nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    special = torch.cat([cuda_nan, torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])])
    out = torch.empty(len(special), dtype=torch.bfloat16)
    for seed in range(20):
        stochastic_round_(out, special, key=seed)
        assert out[:2].isnan().all() and out[2] == float("inf") and out[3] == -float("inf")
        assert out[4] == 0 and not out[4].signbit() and out[5] == 0 and out[5].signbit()
    exact = torch.empty(3)
    stochastic_round_(exact, torch.tensor([1.0 + 1e-7, -3.3, 1e-30]), key=0)
    assert torch.equal(exact, torch.tensor([1.0 + 1e-7, -3.3, 1e-30]))


def test_rounding_draws_are_uniform_and_differ_by_key_and_element():
    """16 uniform bits per element (mean and every bit balanced over 2^18 draws); another key, or
    the same elements at another offset, draws afresh (as many equal draws as chance gives)."""
    draws = rounding_noise(2**31 + 12345, 0, 1 << 18, "cpu").long()
    assert draws.min() >= 0 and draws.max() < 1 << 16
    assert draws.float().mean().item() == pytest.approx(2**15, rel=0.01)
    assert all(((draws >> bit) & 1).float().mean().item() == pytest.approx(0.5, abs=0.01) for bit in range(16))
    for other in (rounding_noise(2**31 + 12346, 0, 1 << 18, "cpu"), rounding_noise(2**31 + 12345, 1, 1 << 18, "cpu")):
        assert (other.long() == draws).float().mean().item() < 10 / 2**16


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no GPU here (the compiled update is a GPU kernel; CPU runs use the eager one, tested above)")
@pytest.mark.parametrize("weight_dtype, state_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32)])
def test_compiled_update_on_gpu_is_the_eager_one(weight_dtype, state_dtype):
    """The GPU's one-kernel update (compiled) against the host's eager one on the same chunk (a
    slice at an offset, as a chunk of a shard is) and draws (32-bit keys). One step: bf16 results
    equal but where the float32 result differs in its last bits (fused multiply-adds, division) and
    that flips a rounding, by one bf16 step; float32 ones to float32 rounding of the update. Later
    steps, with new scalars and keys, reuse the graph (no recompilation)."""
    from torch._dynamo.utils import counters
    from sft.training.optim import _compiled_update, _update
    torch.manual_seed(0)
    n, offset = (1 << 20) + 3, 7  # not a multiple of any block size
    host = [torch.randn(n + offset).to(weight_dtype), torch.randn(n + offset).to(weight_dtype) * 1e-2,
            (torch.randn(n + offset) * 1e-3).to(state_dtype), (torch.rand(n + offset) * 1e-5 + 1e-6).to(state_dtype)]
    gpu = [t.cuda() for t in host]
    weight = host[0].clone()
    scalars = dict(start=offset, keys=(3_000_000_011, 2**31 + 5, 123_456_789), decay=1 - 1e-4, beta1=0.9, beta2=0.95,
                   step_size=1e-3, bias_correction2_sqrt=0.3, eps=1e-8)
    _update(tuple(t[offset:] for t in host), **scalars)
    _compiled_update()(tuple(t[offset:] for t in gpu), **scalars)
    for a, b in ((host[i], gpu[i].cpu()) for i in (0, 2, 3)):  # weight, exp_avg, exp_avg_sq
        assert torch.equal(a[:offset], b[:offset])  # outside the chunk: untouched on both
        if a.dtype == torch.bfloat16:
            assert (a != b).float().mean() < 1e-3
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-9)  # atol: m's cancellations
        elif a is host[0]:  # the update (up to ~0.03 here) to float32 rounding, and the weight's last bit
            torch.testing.assert_close(a - weight, b - weight, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):
        scalars.update(keys=tuple(k + 1 for k in scalars["keys"]), step_size=scalars["step_size"] * 0.9,
                       bias_correction2_sqrt=scalars["bias_correction2_sqrt"] + 0.1)
        _compiled_update()(tuple(t[offset:] for t in gpu), **scalars)
    assert counters["stats"]["unique_graphs"] == graphs
    assert all(t.isfinite().all() for t in gpu)


@pytest.mark.parametrize("state_dtype, master_dtype, total", [("float32", "float32", 16), ("bfloat16", "float32", 12),
                                                              ("bfloat16", "bfloat16", 8)])
def test_state_bytes_per_parameter(state_dtype, master_dtype, total):
    assert state_bytes(OptimConfig(state_dtype=state_dtype, master_dtype=master_dtype)).total == total
