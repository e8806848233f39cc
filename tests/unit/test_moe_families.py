"""Every mixture-of-experts family transformers ships, as a tiny random model from its own config
class: our path (sft/models/moe.py: the model's router and shared experts, our grouped experts)
gives transformers' eager model's logits, gradients and load-balancing term; a block of another
form takes the general path (transformers' block as it is)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import tiny_config
from sft.config import MoEConfig
from sft.models.experts import GroupedExperts
from sft.models.moe import KeepsRouterLogits, SparseMoE, _router, sparse_modules, apply_moe

# (model_type, config overrides, the path its blocks take)
FAMILIES = [
    ("qwen3_moe", {}, "ours"),
    ("qwen3_5_moe_text", {}, "ours"),     # Qwen3.5-MoE: shared expert behind a sigmoid gate, Gated DeltaNet
    ("qwen3_next", {}, "ours"),
    ("qwen2_moe", {}, "ours"),
    ("mixtral", {}, "ours"),
    ("gpt_oss", {}, "ours"),              # transposed, interleaved, biased experts; softmax of the top-k logits
    ("deepseek_v3", {"head_dim": 8, "num_key_value_heads": 4}, "ours"),  # Kimi-K2, Moonlight: sigmoid, groups, correction bias, MLA
    ("deepseek_v2", {"head_dim": 8, "num_key_value_heads": 4}, "ours"),
    ("glm4_moe", {}, "ours"),             # GLM-4.5/4.6/4.7
    ("minimax_m2", {}, "ours"),           # sigmoid with a correction bias on the block
    ("olmoe", {}, "ours"),
    ("flex_olmo", {}, "ours"),
    ("dots1", {}, "ours"),
    ("ernie4_5_moe", {}, "ours"),
    ("exaone_moe", {}, "ours"),
    ("solar_open", {}, "ours"),
    ("granitemoe", {}, "ours"),
    ("phimoe", {"router_jitter_noise": 0.0}, "ours"),
    ("llama4_text", {}, "general"),       # dense experts on routed-and-scaled inputs
    ("hunyuan_v1_moe", {}, "general"),
]
COEF = 0.01


def _routing(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' own (router logits, chosen experts) of every sparse block, by hooks on the
    routers (captured during a forward)."""
    captured = []
    for _, block in sparse_modules(model):
        router = block.get_submodule(_router(block) or "gate")
        router.register_forward_hook(lambda module, args, out: captured.append((out[0], out[-1])))
    return captured


def _load_balancing(captured, num_experts: int) -> torch.Tensor:
    """COEF x the mean over layers of E * sum_e f_e P_e: f_e the share of top-k slots routed to e (as
    the router chose them), P_e the mean softmax probability of e (transformers' load_balancing_loss_func
    where routing is the softmax's top-k; with a correction bias or expert groups the chosen experts
    are counted, not the softmax's top-k)."""
    terms = []
    for logits, chosen in captured:
        f = torch.bincount(chosen.reshape(-1), minlength=num_experts).float() / chosen.shape[0]
        terms.append(num_experts * (f * logits.float().softmax(dim=-1).mean(dim=0)).sum())
    return COEF * sum(terms) / len(terms)


@pytest.mark.parametrize("model_type, overrides, path", FAMILIES, ids=[row[0] for row in FAMILIES])
def test_moe_family_equals_transformers(model_type, overrides, path):
    torch.manual_seed(0)
    config = tiny_config(model_type, **overrides)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():  # a correction bias that matters (DeepSeek-V3, GLM-4.5, MiniMax-M2); biases off zero
        for name, buffer in reference.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.5, 0.5)
        for name, param in reference.named_parameters():
            if name.endswith("_bias") and "experts" in name:
                param.normal_()
    ours = copy.deepcopy(reference)
    ids = torch.randint(3, 800, (2, 16))

    captured = _routing(reference)
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    moe = apply_moe(ours, MoEConfig(aux_loss_coef=COEF))
    assert (moe.general is None) == (path == "ours"), moe.path
    moe.begin_step(torch.tensor(32.0))
    moe.begin_micro_batch(torch.ones(2, 16, dtype=torch.bool))
    got = ours(input_ids=ids, labels=ids)
    moe.end_micro_batch()
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    got.loss.backward()
    if path == "ours":
        aux = _load_balancing(captured, moe.num_experts)
        assert moe.step_stats()[:, 0].sum().item() == pytest.approx(aux.item(), rel=1e-5)
        assert all(isinstance(block, SparseMoE) and isinstance(block.experts, GroupedExperts) for block in moe.blocks)
    # Gradients: transformers' loss (+ our load-balancing term, whose gradient reaches the routers and below)
    expected_grads = dict(reference.named_parameters())
    if path == "ours":
        reference.zero_grad()
        captured.clear()
        out = reference(input_ids=ids, labels=ids)
        (out.loss + _load_balancing(captured, moe.num_experts)).backward()
    for name, param in ours.named_parameters():
        if param.grad is not None or expected_grads[name].grad is not None:
            torch.testing.assert_close(param.grad, expected_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_our_blocks_keep_the_model_s_classes_and_names():
    """apply_moe changes a sparse block, its experts and its router into subclasses of their own
    classes (as FSDP2 does): the parameter names (checkpoints, hub files) stay the model's, and one
    subclass serves every block (one compiled graph)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3", head_dim=8, num_hidden_layers=3))
    names = [name for name, _ in model.named_parameters()]
    classes = {name: type(module) for name, module in model.named_modules()}
    moe = apply_moe(model, MoEConfig())
    assert [name for name, _ in model.named_parameters()] == names
    assert len(moe.blocks) == 2 and len({type(block) for block in moe.blocks}) == 1  # layer 0 is dense
    for name, module in model.named_modules():
        assert isinstance(module, classes[name]), name
        ours = isinstance(module, SparseMoE | GroupedExperts | KeepsRouterLogits)
        assert ours == (type(module) is not classes[name]), name
    assert moe.biased == moe.blocks  # their routers' e_score_correction_bias
