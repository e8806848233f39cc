"""AdamW parameter groups and the warmup + cosine schedule, against their definitions."""

import math

import pytest
import torch

from helpers import DEMO_MODEL
from sft.config import ModelConfig, OptimConfig
from sft.models.build import build_meta_model
from sft.training.optim import build_optimizer, build_scheduler


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
