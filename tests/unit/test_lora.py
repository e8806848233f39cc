"""LoRA in process: target and module names that match nothing, what trains and what the layers are called.
End to end: tests/integration/test_lora.py."""

from __future__ import annotations


import pytest
import torch

from helpers import REPO


# lora.* -> the one error apply_lora gives for the demo model
BAD_TARGETS = {
    ("target_modules", ("qproj",)): "lora.target_modules=['qproj']: qproj names no Linear layer of the decoder blocks; "
                                   "they have down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj",
    ("modules_to_save", ("embeddings",)): "lora.modules_to_save=['embeddings']: embeddings names no module of "
                                         "Qwen2ForCausalLM",
}


@pytest.mark.parametrize("key, value", list(BAD_TARGETS), ids=[key for key, _ in BAD_TARGETS])
def test_names_that_match_nothing_are_one_error_listing_what_there_is(key, value):
    from sft.config import LoRAConfig, ModelConfig
    from sft.models.build import build_meta_model, decoder_blocks
    from sft.models.lora import LoRAError, apply_lora

    model = build_meta_model(ModelConfig(name_or_path=str(REPO / "configs" / "demo" / "model")))
    with pytest.raises(LoRAError) as err:
        apply_lora(model, decoder_blocks(model), LoRAConfig(rank=4, **{key: list(value)}), torch.float32)
    assert str(err.value).startswith(BAD_TARGETS[key, value])


def test_only_the_adapters_and_the_modules_to_save_train_and_the_names_stay():
    from sft.config import LoRAConfig, ModelConfig
    from sft.models.build import build_meta_model, decoder_blocks
    from sft.models.lora import LoRALinear, apply_lora

    model = build_meta_model(ModelConfig(name_or_path=str(REPO / "configs" / "demo" / "model")))
    names = [name for name, _ in model.named_parameters()]
    apply_lora(model, decoder_blocks(model), LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"],
                                                        modules_to_save=["embed_tokens"]), torch.bfloat16)
    params = dict(model.named_parameters())
    assert [name for name in params if ".lora_" not in name] == names  # the base loads by its own names
    trained = sorted(name for name, p in params.items() if p.requires_grad)
    assert trained == sorted([f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight" for i in range(4)
                              for m in ("q_proj", "v_proj") for ab in "AB"] + ["model.embed_tokens.weight"])
    assert {p.dtype for name, p in params.items() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 8
