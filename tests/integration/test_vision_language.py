"""Vision-language checkpoints trained on text (sft/models/vision_language.py): the language model
loads from the checkpoint's own names, trains on 1 and 2 ranks, and exports as the original
checkpoint (its class, config.json and tensor names; the vision tower byte for byte)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from safetensors import safe_open

from helpers import REPO, eval_losses, hf_eval_loss, run_demo, vision_language_model_dir


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.mark.parametrize("model_type,nproc", [("qwen3_5", 2), ("gemma3", 1), ("qwen3_vl", 1), ("glm4v_moe", 2)])
def test_vision_language_checkpoint_trains_its_language_model_and_exports_the_original(tmp_path, demo_data,
                                                                                        model_type, nproc):
    """Qwen3.5 (files under model.language_model., Gated DeltaNet), Gemma-3 (files as published,
    under language_model.model., tied), Qwen3-VL (its text model has no causal class in transformers:
    trained under our head) and GLM-4.5V (experts one tensor each in the files, merged by the
    vision-language class's conversions): the run's first eval equals transformers' own vision-language class on the
    original files, its last eval equals that class loaded from the export; the export has the
    original's config.json and tensor names, and its vision tensors are the original's."""
    from transformers import AutoModelForImageTextToText


    source = vision_language_model_dir(tmp_path, model_type)
    overrides = ["model.init=pretrained", f"model.name_or_path={source}", "train.max_steps=3", "eval.every_steps=3"]
    run_demo(demo_data, tmp_path, "vl", *overrides, nproc=nproc)
    first, last = eval_losses(tmp_path / "vl")[0], eval_losses(tmp_path / "vl")[-1]
    original = AutoModelForImageTextToText.from_pretrained(source)
    assert hf_eval_loss(original, demo_data, source) == pytest.approx(first, rel=1e-5)

    export = tmp_path / "vl" / "export"
    exported, info = AutoModelForImageTextToText.from_pretrained(export, output_loading_info=True)
    assert type(exported) is type(original)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf_eval_loss(exported, demo_data, export) == pytest.approx(last, rel=1e-5)
    assert (export / "config.json").read_text() == (source / "config.json").read_text()
    before, after = _tensors(source), _tensors(export)
    assert sorted(after) == sorted(before)
    unchanged = {name for name in before if torch.equal(before[name], after[name])
                 and before[name].dtype == after[name].dtype}
    tower = {name for name in before if "language_model" not in name and "lm_head" not in name}
    kept = {name for name in before if name.endswith("e_score_correction_bias")}  # GLM-4.5V's routers: buffers
    assert tower and unchanged - kept == tower  # the vision tower as it was; every language-model weight trained

    # The checkpoint exports again, by the command, to the same files.
    again = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "sft.export", str(tmp_path / "vl" / "checkpoints" / "step-3"), str(again),
                    "--dtype", "float32"], cwd=REPO, check=True, capture_output=True)
    assert {name: t.tolist() for name, t in _tensors(again).items()} == {name: t.tolist() for name, t in after.items()}
    if model_type == "qwen3_vl":  # no causal class in transformers: sft.chat loads the original class
        chat = subprocess.run([sys.executable, "-m", "sft.chat", str(export), "--prompt", "hi", "--max-new-tokens", "2"],
                              cwd=REPO, capture_output=True, text=True)
        assert chat.returncode == 0, chat.stderr[-500:]
    # In another dtype its config.json names that dtype, which transformers loads the language model in.
    bf16 = tmp_path / "bf16"
    subprocess.run([sys.executable, "-m", "sft.export", str(tmp_path / "vl" / "checkpoints" / "step-3"), str(bf16),
                    "--dtype", "bfloat16"], cwd=REPO, check=True, capture_output=True)
    config = json.loads((bf16 / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert {k: v for k, v in config.items() if k != "dtype"} == {
        k: v for k, v in json.loads((source / "config.json").read_text()).items() if k != "dtype"}
    assert AutoModelForImageTextToText.from_pretrained(bf16).get_decoder().dtype == torch.bfloat16



def test_lora_on_a_vision_language_checkpoint_merges_into_the_original(tmp_path, demo_data):
    """LoRA on Qwen3.5 as published: the adapters train on the language model, and `sft.export --merge`
    writes the original checkpoint with them merged in (its class; the vision tower as it was)."""
    from transformers import AutoModelForImageTextToText

    source = vision_language_model_dir(tmp_path, "qwen3_5")
    run_demo(demo_data, tmp_path, "lora", "model.init=pretrained", f"model.name_or_path={source}", "lora.rank=8",
             "train.max_steps=2", "eval.every_steps=0", "checkpoint.export_hf=false")
    merged = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "sft.export", str(tmp_path / "lora" / "checkpoints" / "step-2"), str(merged),
                    "--merge", "--dtype", "float32"], cwd=REPO, check=True, capture_output=True)
    model, info = AutoModelForImageTextToText.from_pretrained(merged, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    before, after = _tensors(source), _tensors(merged)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    # each adapted weight is W + (alpha / r) B A of the trained adapter (exported alone), nothing else changed
    adapter = tmp_path / "adapter"
    subprocess.run([sys.executable, "-m", "sft.export", str(tmp_path / "lora" / "checkpoints" / "step-2"), str(adapter),
                    "--dtype", "float32"], cwd=REPO, check=True, capture_output=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    factors = load_file(adapter / "adapter_model.safetensors")
    expected = {}
    for name, lora_a in factors.items():
        if name.endswith(".lora_A.weight"):
            lora_b = factors[name.replace(".lora_A.", ".lora_B.")]
            weight = name.removeprefix("base_model.model.model.").replace(".lora_A.weight", ".weight")
            file_name = f"model.language_model.{weight}"
            expected[file_name] = before[file_name].float() + config["lora_alpha"] / config["r"] * lora_b @ lora_a
    assert changed == set(expected) and len(expected) >= 4, (sorted(changed), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-6)
