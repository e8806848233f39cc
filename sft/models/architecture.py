"""What a model is, as transformers' objects say it: the one place that reads the architecture.

The language model's config (`text_config`: a vision-language checkpoint's text part, or the
config itself), the stack of decoder blocks under the head (`decoder`, `decoder_blocks`), what the
head does to the logits (`Logits`) and whether the head shares the embedding (`tied_embeddings`).
Everything else asks these; the kinds of its layers are sft/models/layers.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from sft.errors import UserError


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config (for a vision-language checkpoint, its text_config)."""
    return config.get_text_config()


def tied_embeddings(config: PretrainedConfig) -> bool:
    """Whether the output layer is the input embedding (one tensor in the files)."""
    return bool(text_config(config).tie_word_embeddings)


@dataclass(frozen=True)
class Logits:
    """What a model's head does to hidden @ lm_head.T before the softmax (transformers' forward of
    its causal-LM class): a scale (Cohere's logit_scale; Granite's and MiniCPM3's 1 / logits_scaling;
    Falcon-H1's lm_head_multiplier; Inkling's 1 / logits_mup_width_multiplier), Gemma-2's soft cap,
    cap * tanh(logits / cap), and the logits the softmax runs over (Inkling's unpadded_vocab_size:
    the first `vocab` rows of lm_head; None: all)."""
    scale: float = 1.0
    cap: float | None = None
    vocab: int | None = None

    @classmethod
    def of(cls, config: PretrainedConfig) -> Logits:
        text = text_config(config)

        def key(name: str, default):
            value = getattr(text, name, None)
            return default if value is None else value
        return cls(key("logit_scale", 1.0) * key("lm_head_multiplier", 1.0) * key("output_multiplier", 1.0)
                   / key("logits_scaling", 1.0) / key("logits_mup_width_multiplier", 1.0),
                   key("final_logit_softcapping", None) or None, key("unpadded_vocab_size", None))


def decoder(model: PreTrainedModel) -> tuple[str, nn.Module]:
    """(its name, the module) of the stack of blocks under the language-model head, which returns the
    last hidden states (`get_decoder`, or the `model` child where a class's get_decoder returns
    the whole model: Llama-4's text class)."""
    inner = model.get_decoder()
    if inner is model:
        inner = model.model
    return next(name for name, module in model.named_modules() if module is inner), inner


def decoder_blocks(model: PreTrainedModel) -> list[nn.Module]:
    """The repeated decoder blocks, found from the model's own `_no_split_modules` (no per-arch code)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    # Through the MRO, so blocks are still found once FSDP has swapped in its FSDP<Block> subclass.
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not blocks:
        raise UserError(f"{type(model).__name__}: cannot find its decoder blocks "
                        f"(_no_split_modules={sorted(names)}); this architecture is not supported")
    return blocks
