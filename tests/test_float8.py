"""Float8 (precision.float8): config checks, which Linears get converted, and that checkpoints,
resume and export are the same with float8 on and off (2 gloo ranks; float8 matmuls run on CPU).

Speed and loss curves need Hopper GPUs: scripts/bench_gpu.sh stages float8 and float8numerics.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from transformers import AutoModelForCausalLM

from helpers import REPO, model_dir, run_torchrun
from sft.config import ConfigError, ModelConfig, check_machine, load_config
from sft.models.build import build_meta_model, decoder_blocks


def write_config(tmp_path: Path) -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": []}\n')
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "configs/demo/model"}, "data": {"path": str(data)},
                                    "compile": {"enabled": True}}))
    return path


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
        load_config(write_config(tmp_path), overrides)
    assert message in str(err.value)


WITHOUT_TORCHAO = """
import sys
sys.modules["torchao"] = None  # as if not installed: find_spec finds nothing, import fails
from sft.config import ConfigError, load_config
from sft.distributed import init_distributed
from sft.models.float8 import precompute_float8_scales, precompute_scales_after_each_step
from sft.models.build import build_meta_model, decoder_blocks
from sft.parallel.mesh import ParallelDims
from sft.parallel.parallelize import parallelize
cfg = load_config(sys.argv[1], ["compile.enabled=false"])
init_distributed()
model = build_meta_model(cfg.model)
parallelize(model, decoder_blocks(model), ParallelDims(1).build("cpu"), cfg.ac, False, cfg.fsdp, cfg.precision.float8)
precompute_float8_scales(model, cfg.precision.float8)  # train.py calls it after every step
try:
    load_config(sys.argv[1], ["precision.float8=tensorwise"])
except ConfigError as e:
    print(e)
cfg = load_config(sys.argv[1], ["precision.float8=tensorwise", "lora.rank=8"])  # LoRA's float8 matmul is ours
import torch
from sft.models.lora import apply_lora
lora_model = build_meta_model(cfg.model)
lora = apply_lora(lora_model, decoder_blocks(lora_model), cfg.lora, torch.bfloat16)
optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
precompute_scales_after_each_step(optimizer, lora_model, "tensorwise", lora)
optimizer.step()  # and has no scales to precompute after a step
print("LoRA with float8 needs no torchao")
"""


@pytest.mark.slow  # a Python of its own: this one has imported torchao (transformers does)
def test_without_torchao_bf16_works_and_float8_names_the_extra(tmp_path):
    """torchao is optional: without it the default path (config, meta model, parallelize, the
    per-step float8 hook) runs, and asking for float8 is a config error that says what to install."""
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCHAO, str(write_config(tmp_path))], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "applied FSDP2" in proc.stdout and "float8 (" not in proc.stdout
    assert "precision.float8='tensorwise': needs torchao: pip install -e '.[fp8]'" in proc.stdout
    assert "LoRA with float8 needs no torchao" in proc.stdout


@pytest.mark.parametrize("device, capability, message", [
    ("cpu", None, "float8 matmuls need NVIDIA GPUs of compute capability >= 8.9"),
    ("cuda", (8, 0), "FAKE-A100 has compute capability 8.0; float8 matmuls need >= 8.9"),
    ("cuda", (9, 0), None),
])
def test_check_machine_float8(tmp_path, monkeypatch, device, capability, message):
    pytest.importorskip("torchao")
    cfg = load_config(write_config(tmp_path), FLOAT8_ON)  # valid at parse time: planning works anywhere
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

    from sft.models.float8 import apply_float8

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

    from sft.models.float8 import float8_linear_config

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
    from sft.models.float8 import frozen_float8_linear

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
    from sft.models.float8 import apply_float8, frozen_float8_linear
    from sft.models.lora import LoRALinear, apply_lora

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


@pytest.mark.slow  # compiles the cast (inductor)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fused_weight_cast_gives_torchao_bytes(device, monkeypatch):
    """A tensorwise weight shard's float8 all-gather input, cast in one compiled kernel
    (fuse_weight_casts), is torchao's own method's, byte for byte: values in range, saturated ones,
    ones that round to zero, zeros. The cuda case runs where there is a GPU."""
    pytest.importorskip("torchao")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU here (run it on one: the GPU's float8 cast is another kernel)")
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    from sft.models.float8 import fuse_weight_casts

    torch.manual_seed(0)
    shard = torch.randn(96, 80, device=device) * 0.05
    # saturating, rounding to zero, zero, and small values that stay in range
    shard[0, :8] = torch.tensor([3.0, -3.0, 1e-9, -1e-9, 0.0, -0.0, 1e-3, -2e-4])
    dtype = torch.float8_e4m3fn
    scale = (torch.finfo(dtype).max / shard[1:].abs().amax()).to(torch.float32)
    weight = Weight(shard, LinearMMConfig(), dtype, precomputed_scale=scale)
    monkeypatch.setattr(Weight, "fsdp_pre_all_gather", Weight.fsdp_pre_all_gather)  # undone after the test
    assert not getattr(Weight.fsdp_pre_all_gather, "fused", False)
    (expected,), (expected_scale,) = weight.fsdp_pre_all_gather(None)  # torchao's

    fuse_weight_casts()
    (data,), (data_scale,) = weight.fsdp_pre_all_gather(None)
    assert data.dtype == dtype and data_scale is expected_scale is scale
    assert torch.equal(data.view(torch.uint8), expected.view(torch.uint8))
    assert data[0, :2].float().abs().tolist() == [torch.finfo(dtype).max] * 2  # saturated, not NaN
    assert data[0, 2:6].float().tolist() == [0.0] * 4 and 0 not in data[0, 6:8].float().tolist()


@pytest.mark.slow
def test_checkpoints_and_export_interchangeable_between_float8_and_bf16(tmp_path):
    """2 gloo ranks through the real path (meta -> float8 -> FSDP2 -> materialize -> load):
    train tensorwise float8 and save; resume that with float8 off, train, save; load the result
    into a rowwise float8 model. Every load is exact, and the export is plain bf16 safetensors.
    The float8 all-gathers' compiled cast (what compiled blocks get) changes no bit of training."""
    pytest.importorskip("torchao")
    model = model_dir(tmp_path, tied=False)

    def worker(name: str, *flags: str) -> dict:
        out = tmp_path / f"{name}.pt"
        run_torchrun(["tests/float8_worker.py", "--model", str(model), "--out", str(out), *flags], nproc=2)
        return torch.load(out)

    f8 = worker("f8", "--float8", "tensorwise", "--steps", "2", "--save", str(tmp_path / "ckpt-f8"))
    bf = worker("bf", "--float8", "none", "--resume", f8["checkpoint"], "--steps", "1",
                "--save", str(tmp_path / "ckpt-bf"), "--reload-as", "rowwise")
    assert len(f8["float8_linears"]) == 28 and bf["float8_linears"] == []
    assert f8["weight_types"] == ["Tensor", "WeightWithDynamicFloat8CastTensor"]  # float8 all-gather is on
    for run in (f8, bf):  # fp32 master weights and Adam moments, plain tensors in the optimizer
        assert run["shard_dtypes"] == ["torch.float32"] and run["moment_types"] == ["Tensor torch.float32"]
    assert f8["losses"][1] < f8["losses"][0]  # it trains
    # Step 2 all-gathers at the scales precomputed after step 1: cast by torchao, or compiled.
    fused = worker("f8-fused", "--float8", "tensorwise", "--steps", "2", "--fuse-casts")
    assert fused["losses"] == f8["losses"]
    for name, tensor in f8["trained"].items():
        assert torch.equal(fused["trained"][name], tensor), name
    for saved, loaded in ((f8["trained"], bf["loaded"]), (bf["trained"], bf["reloaded"])):
        assert saved.keys() == loaded.keys()
        for name in saved:
            assert torch.equal(saved[name], loaded[name]), name
    # Same weights, bf16 vs float8 matmuls: close, but not equal (the float8 path really ran).
    assert bf["loss_reloaded"] == pytest.approx(bf["loss_saved"], rel=2e-2)
    assert bf["loss_reloaded"] != bf["loss_saved"]

    from sft.export import export_hf

    export_hf(Path(f8["checkpoint"]), tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert exported.keys() == f8["trained"].keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, f8["trained"][name].bfloat16()), name
