"""Vision-language checkpoints, trained on text.

Qwen3.5 ships as one checkpoint holding a language model and a vision tower (its config.json has a
text_config and a vision_config), as do Gemma-3/4 from 4B, Mistral-3 and Llama-4. A text run trains
the language model alone, built as the text class transformers ships for the text config
(`Qwen3_5ForCausalLM` for `Qwen3_5TextConfig`). The vision tower, its projector and whatever else
the files hold beyond the language model (Qwen3.5's multi-token-prediction head) are never loaded
on a GPU, sharded, trained or given optimizer state: each checkpoint's hf/ keeps them, bytes as the
files hold them (`KEPT`), beside the original config.json, so that an export is the original
checkpoint: its config.json, its tensor names, the kept tensors byte for byte and the language
model as trained. transformers loads it as the original class, and vLLM serves it.

Where transformers ships no causal class for the text config but a text model class (Qwen3-VL,
Qwen2.5-VL, GLM-4.xV: on text-only rows their multimodal rotary positions are the text positions in
every section), the language model is that model under a head (`under_a_head`), with a causal
class's names (`model.`, `lm_head.`); tests/zoo.py checks its loss against the vision-language class.

The files name the language model's tensors under a prefix of their own: "model.language_model."
as transformers 5 saves Qwen3.5 and Qwen3-VL, "language_model.model." as Gemma-3, Mistral-3 and
Llama-4 were published; the head is `lm_head.weight` or `language_model.lm_head.weight`. Both are
found in the files (by the embedding's name and shape), not from a list of families.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationMixin,
                          PretrainedConfig, PreTrainedModel)
from transformers.modeling_outputs import CausalLMOutputWithPast

from sft.errors import UserError

# The kept tensors in a checkpoint's hf/; its metadata records the language model's names in the files.
KEPT = "kept.safetensors"


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


@dataclass(frozen=True)
class FileNames:
    """How a checkpoint's files name the parameters of the language model that is trained:
    `<base>.X` as `prefix + X`, the head `lm_head.weight` as `head`. The identity for a text model."""
    base: str = "model."
    prefix: str = "model."
    head: str = "lm_head.weight"

    def of(self, name: str) -> str:
        """The files' name of parameter (or hub tensor) `name` of the language model."""
        if name == "lm_head.weight":
            return self.head
        return self.prefix + name.removeprefix(self.base) if name.startswith(self.base) else name

    def in_model(self, file_name: str) -> str | None:
        """The language model's name of the files' tensor `file_name`; None for a tensor outside it
        (the vision tower), as `of` in reverse."""
        if file_name == self.head:
            return "lm_head.weight"
        if file_name.startswith(self.prefix):
            return self.base + file_name.removeprefix(self.prefix)
        return file_name if self.prefix == self.base else None

    def metadata(self) -> dict[str, str]:
        return {"sft.base": self.base, "sft.prefix": self.prefix, "sft.head": self.head}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> FileNames:
        return cls(metadata["sft.base"], metadata["sft.prefix"], metadata["sft.head"])


def checkpoint_class(directory: Path) -> tuple[str, str] | None:
    """The class and model type that a vision-language checkpoint's config.json names (by which
    transformers finds its conversions of the files' tensors); None for a text model's."""
    config = json.loads((directory / "config.json").read_text())
    if "text_config" not in config:
        return None
    return (config.get("architectures") or [""])[0], config.get("model_type", "")


def file_names(file_shapes: dict[str, tuple[int, ...]], base: str, embedding: tuple[int, ...]) -> FileNames:
    """Where the files keep the language model whose parameters are `<base>.X`: found by its token
    embedding (`<base>.embed_tokens.weight`, of shape `embedding`), the only tensor of that name
    and shape among the files' (`file_shapes`); the identity where the files use the model's names
    (or none or several match: check() then names what is missing)."""
    identity = FileNames(f"{base}.", f"{base}.", "lm_head.weight")
    found = [name for name, shape in file_shapes.items()
             if name.endswith(".embed_tokens.weight") and tuple(shape) == tuple(embedding)]
    if f"{base}.embed_tokens.weight" in file_shapes or len(found) != 1:
        return identity
    heads = [name for name in file_shapes if name.endswith("lm_head.weight")]
    return FileNames(f"{base}.", found[0].removesuffix("embed_tokens.weight"),
                     heads[0] if len(heads) == 1 else "lm_head.weight")


def kept_names(file_names_: Iterable[str], trained: Iterable[str]) -> list[str]:
    """The files' tensors that the trained model does not hold (its parameters, by their names in
    the files: `trained`): the vision tower and the rest, kept as they are."""
    trained = set(trained)
    return sorted(name for name in file_names_ if name not in trained)
