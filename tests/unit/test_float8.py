"""Float8 (precision.float8) in process: config checks, which Linears get converted, LoRA's float8 base
matmul against float8 round trips by hand. In processes of their own: tests/integration/test_float8.py."""


import pytest
import torch
from torch import nn

from helpers import REPO, compiled_demo_config, model_dir
from sft.config import ConfigError, ModelConfig, check_machine, load_config
from sft.models.architecture import decoder_blocks
from sft.models.build import build_meta_model


FLOAT8_ON = ["precision.float8=tensorwise"]


@pytest.mark.parametrize("overrides, message", [
    (["precision.float8=fp8"], "precision.float8='fp8': expected one of ['none', 'tensorwise', 'rowwise']"),
    (FLOAT8_ON + ["compile.enabled=false"], "precision.float8='tensorwise': needs compile.enabled=true"),
    (["precision.float8=rowwise", "fsdp.param_dtype=float32"],
     "precision.float8='rowwise': needs fsdp.param_dtype=bfloat16"),
    (FLOAT8_ON + ["fsdp.cpu_offload=true"], "precision.float8='tensorwise': not supported with fsdp.cpu_offload"),
])
def test_float8_config_errors_name_key_and_fix(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(compiled_demo_config(tmp_path), overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("device, capability, message", [
    ("cpu", None, "float8 matmuls need NVIDIA GPUs of compute capability >= 8.9"),
    ("cuda", (8, 0), "FAKE-A100 has compute capability 8.0; float8 matmuls need >= 8.9"),
    ("cuda", (9, 0), None),
])
def test_check_machine_float8(tmp_path, monkeypatch, device, capability, message):
    pytest.importorskip("torchao")
    cfg = load_config(compiled_demo_config(tmp_path), FLOAT8_ON)  # valid at parse time: planning works anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "FAKE-A100")
    if message is None:
        check_machine(cfg, torch.device(device, 0))
        return
    with pytest.raises(ConfigError, match="precision.float8='tensorwise'") as err:
        check_machine(cfg, torch.device(device))
    assert message in str(err.value)


def test_conversion_picks_block_linears_aligned_to_16_and_keeps_state_dict(tmp_path, capsys):
    """On the meta model: every block Linear with both dims multiples of 16 becomes Float8Linear;
    the MLP (intermediate 200) stays nn.Linear; lm_head and embeddings are untouched; the state
    dict (what the loader, DCP and export see) keeps its keys, shapes and dtypes."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from sft.parallel.float8 import apply_float8

    cfg = ModelConfig(name_or_path=str(model_dir(tmp_path, tied=False, intermediate_size=200)))
    plain, model = build_meta_model(cfg), build_meta_model(cfg)
    apply_float8(decoder_blocks(model), "tensorwise")

    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    expected = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(4) for p in "qkvo"}
    assert converted == expected
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert type(model.get_submodule(f"model.layers.0.mlp.{name}")) is nn.Linear
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    before = {k: (v.shape, v.dtype) for k, v in plain.state_dict().items()}
    after = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    assert after == before
    assert all(p.is_meta for p in model.parameters())
    log = capsys.readouterr().out
    assert ("applied float8 (tensorwise) to 16 linears in 4 blocks, skipped 12: 8 with in/out features 128/200 "
            "not multiples of 16 (e.g. mlp.gate_proj); 4 with in/out features 200/128 not multiples of 16 "
            "(e.g. mlp.down_proj)") in log


def test_rowwise_uses_rowwise_scaling_and_no_float8_all_gather():
    pytest.importorskip("torchao")
    from torchao.float8 import ScalingGranularity

    from sft.parallel.float8 import float8_linear_config

    tensorwise, rowwise = float8_linear_config("tensorwise"), float8_linear_config("rowwise")
    assert tensorwise.enable_fsdp_float8_all_gather
    assert tensorwise.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
    assert not rowwise.enable_fsdp_float8_all_gather
    assert rowwise.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE


def float8_round_trip(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
    """`t` through float8 and back in float32, at a power-of-two scale that maps the largest magnitude
    (of the whole tensor, or of each slice along `dim`) to at most float8's largest value."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(torch.finfo(dtype).max / amax.float())))
    return (t.float() * scale).to(dtype).float() / scale


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_lora_base_matmul_in_float8_is_the_round_trip_matmul_without_weight_gradient(recipe, device):
    """frozen_float8_linear is x W^T on float8 round trips of x and W (the backward: of the output's
    gradient, e5m2 with tensorwise scales, and W), computed once by hand here; W gets no gradient.
    Rows of x a million times apart: rowwise scales keep every row's error at float8's, one scale for
    the tensor flushes the small rows to nothing. The cuda case runs where there is a GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU here (run it on one: the GPU's float8 matmul is another kernel)")
    if device == "cpu" and recipe == "rowwise" and torch.__version__ < "2.13":
        pytest.skip("before torch 2.13 the CPU's float8 matmul takes one scale per tensor only")
    from sft.parallel.float8 import frozen_float8_linear

    torch.manual_seed(0)
    x = (torch.randn(2, 16, 64) * torch.logspace(-4, 2, 16).view(1, 16, 1)).bfloat16().to(device).requires_grad_()
    weight = (torch.randn(48, 64) * 0.05).bfloat16().to(device)
    grad = torch.randn(2, 16, 48).bfloat16().to(device)
    out = frozen_float8_linear(x, weight, recipe)
    out.backward(grad)
    rowwise, e4m3 = recipe == "rowwise", torch.float8_e4m3fn
    expected = float8_round_trip(x, e4m3, -1 if rowwise else None) @ float8_round_trip(weight, e4m3, -1 if rowwise else None).T
    expected_grad = (float8_round_trip(grad, e4m3 if rowwise else torch.float8_e5m2, -1 if rowwise else None)
                     @ float8_round_trip(weight, e4m3, 0 if rowwise else None))
    assert out.dtype == x.grad.dtype == torch.bfloat16 and weight.grad is None

    def row_errors(result: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Each row's error relative to the row (rows are 1e6 apart; elements may cancel to ~0)."""
        return ((result.float() - reference).norm(dim=-1) / reference.norm(dim=-1).clamp(min=1e-30)).flatten()

    assert row_errors(out, expected).max() < 1e-2  # bf16 output, float32 sums in another order
    assert row_errors(x.grad, expected_grad).max() < 1e-2
    errors = row_errors(out, x.float() @ weight.float().T)
    if rowwise:
        assert errors.max() < 0.08
    else:
        assert errors.max() >= 1 and errors.min() < 0.08  # the smallest rows lost (or became zeros)


def test_with_lora_only_the_adapted_layers_base_matmuls_turn_float8(capsys):
    """With LoRA, float8 marks the adapted layers (their frozen base matmuls run in float8) and
    converts nothing else: the adapters and the frozen Linears without one stay bf16 Linears (the
    log names them), and torchao is not needed."""
    from sft.config import LoRAConfig
    from sft.parallel.float8 import apply_float8, frozen_float8_linear
    from sft.adapters.lora import LoRALinear, apply_lora

    model = build_meta_model(ModelConfig(name_or_path=str(REPO / "configs" / "demo" / "model")))
    blocks = decoder_blocks(model)
    lora = apply_lora(model, blocks, LoRAConfig(rank=4, target_modules=["q_proj", "up_proj"]), torch.bfloat16)
    apply_float8(blocks, "rowwise", lora=lora)
    adapted = {name: m.base_matmul for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert len(adapted) == 8 and all(f.func is frozen_float8_linear and f.keywords == {"recipe": "rowwise"}
                                     for f in adapted.values())
    assert {type(m) for name, m in model.named_modules() if name.endswith(("lora_A", "lora_B", "k_proj"))} == {nn.Linear}
    assert ("applied float8 (rowwise) to the frozen base matmuls of 8 linears in 4 blocks, skipped 20: 20 with no "
            "adapter (e.g. self_attn.k_proj)") in capsys.readouterr().out
