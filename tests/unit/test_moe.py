"""Mixture of experts (sft/models/moe.py) on a tiny Qwen3-MoE: the grouped GEMM against the per-expert loop,
routing kept under checkpoint recomputation, the hub layout of expert weights both ways, and the MoE
demo end to end (learns, resumes exactly, exports what transformers reloads). The 2-rank comparisons
with Hugging Face's eager MoE are rows of tests/integration/test_distributed.py (MOE_RUNS)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors import safe_open

from helpers import DEMO_MOE_MODEL, OpCounter, gpt_oss_model_dir, hf_moe_model, moe_model_dir
from sft.config import ACConfig, MoEConfig, ModelConfig
from sft.hub.weights import SafetensorsWeights
from sft.models.architecture import decoder_blocks
from sft.models.build import build_meta_model
from sft.models.experts import _per_expert_linear, grouped_linear
from sft.models.moe import apply_moe
from sft.parallel.activation_checkpointing import apply_ac


def test_grouped_gemm_equals_the_per_expert_loop_in_bf16():
    """The bf16 grouped GEMM (what GPUs run) and the fallback loop agree, forward and backward, also
    with an expert that gets no token; float32 operands take the loop."""
    torch.manual_seed(0)
    rows, hidden, out, experts = 40, 64, 48, 4
    ends = torch.tensor([10, 10, 25, 40], dtype=torch.int32)  # expert 1 gets no row
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(experts, out, hidden, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, out, dtype=torch.bfloat16)
    results = []
    for linear in (grouped_linear, lambda x, w, ends: _per_expert_linear(x, w.transpose(-2, -1), ends)):
        x.grad = w.grad = None
        y = linear(x, w, ends)
        y.backward(grad)
        results.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert results[0][2][1].abs().max() == 0  # the idle expert's gradient
    assert torch.equal(grouped_linear(x.float(), w.float(), ends),
                       _per_expert_linear(x.float(), w.float().transpose(-2, -1), ends))


@pytest.mark.parametrize("mode", ["blocks", "ops", "ops_half", "attention"])
def test_checkpoint_recomputation_does_not_route_again(mode):
    """With every block checkpointed, backward recomputes the blocks but never the top-k: the
    routing decision is saved (the 2-rank rows check the gradients are bitwise those without AC)."""
    model = hf_moe_model()
    router = apply_moe(model, MoEConfig())
    apply_ac(model, decoder_blocks(model), ACConfig(1.0, mode), always_kept=router.kept_ops)
    ids = torch.randint(0, 800, (2, 16))
    router.begin_step(torch.tensor(32.0))
    router.begin_micro_batch(torch.ones(2, 16, dtype=torch.bool))
    with OpCounter() as calls:
        loss = model(input_ids=ids, labels=ids).loss
        forward = Counter(calls.counts)
        loss.backward()
    backward = calls.counts - forward
    assert forward["topk"] == 4
    assert backward["topk"] == 0
    assert backward["mm"] > 0  # something was recomputed (whole blocks) or differentiated


# (architecture, config.json overrides of the MoE demo, a hub name of expert 3's gate, of layer 0's router)
HUB_LAYOUTS = [("qwen3_moe", {}, "model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.gate.weight"),
               ("mixtral", {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                            "intermediate_size": 96},
                "model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.0.block_sparse_moe.gate.weight")]


@pytest.mark.parametrize("arch, overrides, expert_key, router_key", HUB_LAYOUTS, ids=[row[0] for row in HUB_LAYOUTS])
def test_expert_weights_load_from_the_hub_layout(tmp_path, arch, overrides, expert_key, router_key):
    """A checkpoint saved by transformers (one tensor per expert; Mixtral's under block_sparse_moe) is
    read into the fused parameters, any slice of experts and rows (what a rank's shard asks for),
    with the shapes checked first; export's renaming gives back the names transformers wrote."""
    from sft.hub.layout import to_hub_tensors

    directory = moe_model_dir(tmp_path, **overrides)
    model = hf_moe_model(directory)
    model.save_pretrained(directory)
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert {expert_key, router_key} <= keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    assert {name for name, _ in to_hub_tensors(model, model.state_dict().items()) if name != "lm_head.weight"} == keys
    meta = build_meta_model(ModelConfig(name_or_path=str(directory)))
    weights = SafetensorsWeights(str(directory), meta)
    weights.check()
    fused = model.model.layers[1].mlp.experts
    intermediate = fused.gate_up_proj.shape[1] // 2
    for index in [(slice(0, 8), slice(0, 2 * intermediate), slice(0, 128)),
                  (slice(2, 5), slice(intermediate - 8, intermediate + 8), slice(0, 128)),  # across gate | up
                  (slice(7, 8), slice(intermediate, 2 * intermediate), slice(16, 32))]:
        read = weights.read("model.layers.1.mlp.experts.gate_up_proj", index, torch.device("cpu"))
        assert torch.equal(read, fused.gate_up_proj.detach()[index])
    down = (slice(1, 3), slice(0, 128), slice(0, intermediate))
    assert torch.equal(weights.read("model.layers.1.mlp.experts.down_proj", down, torch.device("cpu")),
                       fused.down_proj.detach()[down])
    assert torch.equal(weights.read("model.layers.0.mlp.gate.weight", (slice(0, 8), slice(0, 128)), torch.device("cpu")),
                       model.model.layers[0].mlp.gate.weight.detach())


def test_gpt_oss_experts_equal_hf_eager(tmp_path):
    """gpt-oss (transposed experts, interleaved gate/up, biases, clamped SwiGLU, softmax over the top-k
    logits): our block's logits and load-balancing term equal transformers' eager model."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = hf_moe_model(gpt_oss_model_dir(tmp_path), attn_implementation="eager")
    with torch.no_grad():  # non-zero biases, and gate/up values past the clamp
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_()
            layer.mlp.experts.down_proj_bias.normal_()
            layer.mlp.experts.gate_up_proj.mul_(50)
    ids = torch.randint(0, 800, (2, 16))
    expected = model(input_ids=ids, output_router_logits=True)
    router = apply_moe(model, MoEConfig())
    router.begin_step(torch.tensor(32.0))
    router.begin_micro_batch(torch.ones(2, 16, dtype=torch.bool))
    logits = model(input_ids=ids).logits
    router.end_micro_batch()
    torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-5)
    config = model.config
    aux = config.router_aux_loss_coef * sum(load_balancing_loss_func((x,), 4, 2) for x in expected.router_logits) / 2
    assert router.step_stats()[:, 0].sum().item() == pytest.approx(aux.item(), rel=1e-5)


def test_mxfp4_experts_stop_with_the_fix(tmp_path):
    from safetensors.torch import save_file

    from sft.models.build import ModelError

    directory = gpt_oss_model_dir(tmp_path)
    meta = build_meta_model(ModelConfig(name_or_path=str(directory), attn_implementation="eager"))
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 128, 2, 16, dtype=torch.uint8)},
              directory / "model.safetensors")
    with pytest.raises(ModelError, match="MXFP4-quantised experts.*Mxfp4Config\\(dequantize=True\\)"):
        SafetensorsWeights(str(directory), meta).check()


def test_real_tokens_mark_everything_but_padding():
    """The load-balancing loss's token mask: each sample's tokens, padded or packed, whatever their ids
    (a pad id that is also a real token, e.g. EOS, stays real)."""
    from sft.data.collate import collate, collate_packed

    samples = [{"input_ids": [5, 0, 0], "labels": [-100, 0, 0]}, {"input_ids": [7] * 5, "labels": [7] * 5}]
    padded = collate(samples, pad_token_id=0, max_seq_len=16, pad_to_multiple_of=8)
    assert padded["real_tokens"].tolist() == [[True] * 3 + [False] * 5, [True] * 5 + [False] * 3]
    packed = collate_packed([samples], pad_token_id=0, row_len=12)
    assert packed["real_tokens"].tolist() == [[True] * 8 + [False] * 4]


def test_an_architecture_gets_an_attention_it_can_run(tmp_path):
    """model.attn_implementation where the class can run it; gpt-oss (no SDPA: attention sinks) falls
    back to eager on a CPU; an implementation asked for that the class has stays as asked."""
    from sft.config import ModelConfig
    from sft.models.build import build_meta_model

    def built(path, attention: str) -> str:
        return build_meta_model(ModelConfig(name_or_path=str(path), attn_implementation=attention)).config._attn_implementation

    assert built(DEMO_MOE_MODEL, "sdpa") == "sdpa" and built(DEMO_MOE_MODEL, "eager") == "eager"
    assert built(gpt_oss_model_dir(tmp_path), "sdpa") == "eager"
    assert built(gpt_oss_model_dir(tmp_path), "flex_attention") == "flex_attention"
