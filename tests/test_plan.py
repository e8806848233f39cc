"""The memory planner against the peaks measured on the GPUs (docs/BENCHMARKS.md)."""

import subprocess
import sys

import pytest

from helpers import REPO
from sft.config import ModelConfig
from sft.model import build_meta_model
from sft.plan import GIB, Shapes, peak_bytes

# Peaks measured on H200s (torch.cuda.max_memory_allocated, docs/BENCHMARKS.md "Memory planner"):
# (model, GPUs, tokens per micro-batch, ac.ratio, compiled, reshard_after_forward, grad-acc) -> GiB.
MEASURED = {
    ("qwen2.5-7b", 4, 8192, 0.0, True, True, 1): 63.5,
    ("qwen2.5-7b", 4, 8192, 0.5, True, True, 1): 48.4,
    ("qwen2.5-7b", 4, 8192, 1.0, True, True, 1): 34.0,
    ("qwen2.5-7b", 4, 8192, 0.0, False, True, 1): 78.8,
    ("qwen2.5-7b", 4, 8192, 0.5, False, True, 1): 55.5,
    ("qwen2.5-7b", 4, 8192, 1.0, False, True, 1): 34.4,
    ("qwen2.5-7b", 4, 4096, 0.0, True, True, 1): 45.9,
    ("qwen2.5-7b", 4, 4096, 0.5, True, True, 1): 37.8,
    ("qwen2.5-7b", 4, 4096, 1.0, True, True, 1): 33.5,
    ("qwen2.5-7b", 4, 8192, 0.0, True, False, 1): 75.2,
    ("qwen2.5-7b", 4, 8192, 0.0, True, True, 4): 70.6,
    ("qwen2.5-0.5b", 1, 4096, 0.0, True, True, 1): 12.1,
    ("qwen2.5-0.5b", 1, 4096, 0.5, True, True, 1): 10.3,
    ("qwen2.5-0.5b", 1, 4096, 1.0, True, True, 1): 8.6,
    ("qwen2.5-0.5b", 1, 8192, 0.0, True, True, 1): 16.9,
    ("qwen2.5-0.5b", 1, 8192, 0.5, True, True, 1): 13.3,
    ("qwen2.5-0.5b", 1, 8192, 1.0, True, True, 1): 9.8,
    ("qwen2.5-14b", 4, 8192, 0.0, True, True, 2): 119.7,
}


@pytest.fixture(scope="module")
def shapes() -> dict[str, Shapes]:
    return {name: Shapes.of(build_meta_model(ModelConfig(name_or_path=str(REPO / "configs/models" / name))))
            for name in ("qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-14b")}


@pytest.fixture(scope="module")
def qwen7b(shapes) -> Shapes:
    return shapes["qwen2.5-7b"]


@pytest.mark.parametrize("case", MEASURED, ids=lambda c: "-".join(map(str, c)))
def test_prediction_within_ten_percent_of_the_measured_peak(shapes, case):
    model, gpus, tokens, ratio, compiled, reshard, grad_accum = case
    predicted = peak_bytes(shapes[model], gpus, tokens, tokens // 2, ratio, compiled, reshard, grad_accum) / GIB
    assert predicted == pytest.approx(MEASURED[case], rel=0.10)


def test_more_checkpointing_and_more_gpus_need_less_memory(qwen7b):
    by_ratio = [peak_bytes(qwen7b, 8, 8192, 4096, r, True) for r in (0, 0.25, 0.5, 0.75, 1)]
    assert by_ratio == sorted(by_ratio, reverse=True)
    assert peak_bytes(qwen7b, 64, 8192, 4096, 1, True) < peak_bytes(qwen7b, 8, 8192, 4096, 1, True)


def test_cli_suggests_a_setting_that_fits():
    proc = subprocess.run([sys.executable, "-m", "sft.plan", "--config", "configs/qwen72b.yaml", "--gpus", "64",
                           "--gpu-mem", "80", "model.name_or_path=configs/models/qwen2.5-72b"],
                          cwd=REPO, capture_output=True, text=True, check=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    out = proc.stdout
    assert "72.71B parameters, 80 blocks, 64 GPUs" in out
    assert "this config (micro-batch 2, ac.ratio 1):" in out and "— fits" in out
    assert "suggested: ac.ratio=" in out and "(global batch 128)" in out


def test_auto_plan_keeps_the_global_batch_and_fits(tmp_path):
    from sft.config import load_config
    from sft.plan import apply_auto_plan, predict_gib

    data = tmp_path / "d.jsonl"
    data.touch()
    cfg = load_config(REPO / "configs/qwen32b.yaml", [f"data.path={data}", "model.name_or_path=configs/models/qwen2.5-32b"])
    line = apply_auto_plan(cfg, gpus=64, gpu_mem_gib=60)
    assert cfg.train.micro_batch_size * cfg.train.grad_accum_steps * 64 == 128
    shapes = Shapes.of(build_meta_model(cfg.model))
    assert predict_gib(shapes, cfg, 64, cfg.train.micro_batch_size, cfg.ac.ratio) <= 60
    assert line.startswith(f"plan.auto: ac.ratio={cfg.ac.ratio:g}")
    # A tighter budget needs more recomputation.
    tight = load_config(REPO / "configs/qwen32b.yaml", [f"data.path={data}", "model.name_or_path=configs/models/qwen2.5-32b"])
    apply_auto_plan(tight, gpus=64, gpu_mem_gib=40)
    assert tight.ac.ratio > cfg.ac.ratio or tight.train.micro_batch_size < cfg.train.micro_batch_size
