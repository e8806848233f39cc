"""Which layers attend, by the kinds transformers' configs name (config.layer_types): MFU's attention
term, and the maskless causal SDPA that rows of one sequence take."""

import pytest
from transformers import AutoConfig

from helpers import FALCON_H1, REPO, tiny_config, tiny_model_dir
from sft.config import ModelConfig
from sft.models.build import build_meta_model, use_causal_sdpa
from sft.models.layers import attention_layer_count
from sft.models.packing import stateful_layers


@pytest.mark.parametrize("config, attending", [
    ("qwen3.5-9b", 8),    # 24 Gated DeltaNet ("linear_attention") layers, 8 attention layers
    ("qwen2.5-7b", 28),   # no layer_types: every layer attends
], ids=str)
def test_mfu_counts_attention_over_the_layers_that_attend(config, attending):
    assert attention_layer_count(AutoConfig.from_pretrained(REPO / "configs/models" / config)) == attending


def test_kinds_that_attend_otherwise_count_as_attending(tmp_path):
    """Falcon-H1's "hybrid" layers run attention beside their Mamba mixer; DeepSeek-V3.2's
    "indexed_attention" attends through its indexer, which reads the attention mask: both attend,
    and DeepSeek-V3.2 keeps its mask (no maskless causal SDPA: its indexer would get None)."""
    falcon = tiny_config("falcon_h1")
    assert attention_layer_count(falcon) == falcon.num_hidden_layers > 0
    deepseek = tiny_config("deepseek_v32")
    assert attention_layer_count(deepseek) == deepseek.num_hidden_layers
    model = build_meta_model(ModelConfig(name_or_path=str(tiny_model_dir(tmp_path, "deepseek_v32"))))
    assert not use_causal_sdpa(model, packing=False)
    assert stateful_layers(model) is None  # nothing passes along the row: its packed rows are checked in the zoo
    assert stateful_layers(build_meta_model(ModelConfig(name_or_path=str(tiny_model_dir(tmp_path, "falcon_h1", **FALCON_H1))))) \
        == "FalconH1ForCausalLM's hybrid layers (FalconH1Mixer)"

