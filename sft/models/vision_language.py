"""Vision-language checkpoints, trained on text.

A checkpoint holding a language model and a vision tower (its config.json has a text_config: Qwen3.5,
Gemma-3/4 from 4B, Mistral-3, Llama-4) trains its language model alone, built as transformers' text
class for the text config (`Qwen3_5ForCausalLM` for `Qwen3_5TextConfig`). The tower and whatever else
the files hold (Qwen3.5's multi-token-prediction head) are never loaded on a GPU, sharded or trained:
each checkpoint's hf/ keeps them byte for byte (sft/hub/vision_language.py), so that an export is the
original checkpoint, which transformers loads as the original class and vLLM serves.
Where transformers ships no causal class for the text config but a text model class (Qwen3-VL,
Qwen2.5-VL, GLM-4.xV: on text rows their multimodal rotary positions are the text positions), the
language model is that model under a head (`under_a_head`, with a causal class's names `model.`,
`lm_head.`); tests/zoo.py checks its loss against the vision-language class.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationMixin,
                          PretrainedConfig, PreTrainedModel)
from transformers.modeling_outputs import CausalLMOutputWithPast

from sft.errors import UserError


def causal_class(config: PretrainedConfig) -> type[PreTrainedModel] | None:
    """transformers' causal language model class for `config`, None where it ships none."""
    return AutoModelForCausalLM._model_mapping.get(type(config), None)


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether config.json describes a model with a language model inside it (a text_config beside a
    vision or audio one; not an encoder-decoder's decoder)."""
    return "text_config" in (getattr(config, "sub_configs", None) or {})


def language_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config the trained model is built from: `config`, or a vision-language config's text
    config, its embeddings tied as the whole model ties them (the top-level setting governs)."""
    if not is_vision_language(config):
        return config
    text = copy.deepcopy(config.get_text_config(decoder=True))
    architecture = (config.architectures or [type(config).__name__])[0]
    if causal_class(text) is None and under_a_head(config) is None:
        raise UserError(f"{architecture}: transformers has no causal language model class for its text config "
                        f"({type(text).__name__}), nor a text model class to put under a head, so its language model "
                        "cannot be trained alone")
    tied = getattr(config, "tie_word_embeddings", None)
    text.tie_word_embeddings = getattr(text, "tie_word_embeddings", False) if tied is None else tied
    text.architectures = None  # it is the inner model, not the checkpoint's class
    return text


def under_a_head(config: PretrainedConfig) -> type[PreTrainedModel] | None:
    """For the text config of a vision-language checkpoint `config` (an image-text-to-text model)
    that transformers has no causal class for but a text model class (Qwen3-VL's): a causal class
    of that model under a head (`_under_a_head`); else None. build_meta_model refuses one whose
    attention does not attend causally (a text encoder's)."""
    if AutoModelForImageTextToText._model_mapping.get(type(config), None) is None:
        return None
    text = config.get_text_config(decoder=True)
    if causal_class(text) is not None:
        return None
    base = AutoModel._model_mapping.get(type(text), None)
    return None if base is None or not is_text_model(base) else _under_a_head(base)


def is_text_model(cls: type[PreTrainedModel]) -> bool:
    """Whether a model class takes text alone (what a vision-language checkpoint's text model does)."""
    modalities = getattr(cls, "input_modalities", ("text",))
    return (modalities,) == ("text",) if isinstance(modalities, str) else tuple(modalities) == ("text",)


@functools.cache
def _under_a_head(base: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """A causal language model class of transformers' text model class `base`: the model as `model`,
    a bias-free Linear head as `lm_head` (tied to the embedding where the config ties them), the
    names, attention implementations and weight init of `base`'s own family."""
    family = next(c for c in base.__mro__[1:] if issubclass(c, PreTrainedModel))

    class CausalLM(family, GenerationMixin):
        config_class = base.config_class
        base_model_prefix = "model"
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

        def __init__(self, config):
            super().__init__(config)
            self.model = base(config)
            self.vocab_size = config.vocab_size
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                    **kwargs) -> CausalLMOutputWithPast:
            # the text model's own arguments as this transformers names them (its cache among them)
            out = self.model(input_ids=input_ids, **kwargs)
            logits = self.lm_head(out.last_hidden_state)
            loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits,
                                          past_key_values=getattr(out, "past_key_values", None))

    CausalLM.__name__ = CausalLM.__qualname__ = base.__name__.removesuffix("Model") + "ForCausalLM"
    CausalLM.__module__ = __name__
    globals()[CausalLM.__name__] = CausalLM  # found by its name: instances pickle
    return CausalLM
