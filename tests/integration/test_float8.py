"""Float8 (precision.float8) in processes of their own: without torchao, the fused weight cast (compiled),
and checkpoints, resume and export the same with float8 on and off (2 gloo ranks; float8 matmuls run
on CPU). Config checks, conversion and the LoRA matmul: tests/unit/test_float8.py.

Speed and loss curves need Hopper GPUs: scripts/bench_gpu.sh stages float8 and float8numerics.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import REPO, compiled_demo_config, model_dir, run_torchrun


WITHOUT_TORCHAO = """
import sys
sys.modules["torchao"] = None  # as if not installed: find_spec finds nothing, import fails
from sft.config import ConfigError, load_config
from sft.distributed import init_distributed
from sft.parallel.float8 import precompute_float8_scales, precompute_scales_after_each_step
from sft.models.architecture import decoder_blocks
from sft.models.build import build_meta_model
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
from sft.adapters.lora import apply_lora
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
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCHAO, str(compiled_demo_config(tmp_path))], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "applied FSDP2" in proc.stdout and "float8 (" not in proc.stdout
    assert "precision.float8='tensorwise': needs torchao: pip install -e '.[fp8]'" in proc.stdout
    assert "LoRA with float8 needs no torchao" in proc.stdout


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

    from sft.parallel.float8 import fuse_weight_casts

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
