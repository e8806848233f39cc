"""This year's mixture-of-experts families end to end, each from a checkpoint laid out as the hub's
(saved by transformers: one tensor per expert; MiniMax-M2's blocks under block_sparse_moe; the
correction bias of DeepSeek-V3-style routers): the run's first eval is transformers' own loss on
those files, a resumed run repeats the steps exactly (the correction bias moving each step), and
the export loads back as the same class to the last eval. Equality with transformers' blocks, one
family at a time: tests/unit/test_moe_families.py."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from helpers import eval_losses, hf_eval_loss, run_demo, saved_model_dir, train_losses

# (model_type, config overrides, ranks, run overrides)
FAMILIES = [
    ("deepseek_v3", {"head_dim": 8, "num_key_value_heads": 4}, 2, ["moe.ep_degree=2", "moe.bias_update_rate=0.01"]),
    ("minimax_m2", {}, 1, ["moe.bias_update_rate=0.01"]),
    ("glm4_moe", {}, 1, []),
    ("qwen3_next", {}, 2, []),
]


@pytest.mark.parametrize("model_type, overrides, nproc, run", FAMILIES, ids=[row[0] for row in FAMILIES])
def test_moe_family_loads_resumes_exactly_and_exports(tmp_path, demo_data, model_type, overrides, nproc, run):
    from transformers import AutoModelForCausalLM

    source = saved_model_dir(tmp_path, model_type, **overrides)
    common = ["model.init=pretrained", f"model.name_or_path={source}", "train.max_steps=4", "eval.every_steps=4",
              "fsdp.param_dtype=float32", *run]
    proc = run_demo(demo_data, tmp_path, "whole", *common, "checkpoint.every_steps=2", nproc=nproc)
    assert "blocks on our path" in proc.stdout
    run_demo(demo_data, tmp_path, "resumed", *common, f"checkpoint.resume={tmp_path / 'whole/checkpoints/step-2'}",
             nproc=nproc)
    whole, resumed = train_losses(tmp_path / "whole"), train_losses(tmp_path / "resumed")
    assert [resumed[step] for step in (3, 4)] == [whole[step] for step in (3, 4)]

    original = AutoModelForCausalLM.from_pretrained(source)
    assert hf_eval_loss(original, demo_data, source) == pytest.approx(eval_losses(tmp_path / "whole")[0], rel=1e-5)
    export = tmp_path / "whole" / "export"
    exported, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert type(exported) is type(original) and not info["missing_keys"] and not info["unexpected_keys"]
    assert hf_eval_loss(exported, demo_data, export) == pytest.approx(eval_losses(tmp_path / "whole")[-1], rel=1e-5)
    with safe_open(next(source.glob("*.safetensors")), framework="pt") as f:
        names = set(f.keys())
    assert not any(name.endswith("experts.gate_up_proj") for name in names)  # the hub's per-expert layout
    biases = [name for name in names if name.endswith("e_score_correction_bias")]
    if "moe.bias_update_rate=0.01" in run:  # the bias moved, 0.01 a step, and the export holds it
        assert biases, sorted(names)  # the family has correction biases (else the loop below checks nothing)
        state = exported.state_dict()
        for name in biases:
            moved = (state[name.replace("block_sparse_moe", "mlp")] - original.state_dict()[
                name.replace("block_sparse_moe", "mlp")]).abs()
            assert moved.max().item() == pytest.approx(0.04, abs=1e-6), name
