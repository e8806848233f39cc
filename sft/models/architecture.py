"""What a model is, as transformers' objects say it: the language model's config, the decoder and
its blocks, what the head does to the logits. Everything else asks these (its layers' kinds:
sft/models/layers.py)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from sft.errors import UserError


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config (for a vision-language checkpoint, its text_config)."""
    return config.get_text_config()


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
    def of(cls, model: PreTrainedModel) -> Logits:
        """`model`'s head, or one line where the fused lm_head + cross-entropy cannot compute it."""
        name = type(model).__name__
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise UserError(f"{name}: the output layer is not a bias-free Linear, which the fused lm_head + "
                            "cross-entropy needs; this architecture is not supported")
        text = text_config(model.config)
        if getattr(text, "logits_soft_cap", None) or "final_logits_bias" in dict(model.named_buffers()):
            raise UserError(f"{name}: its head post-processes logits in a way the fused lm_head + cross-entropy "
                            "does not (a logits_soft_cap or a final_logits_bias); this architecture is not supported")

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
    """The repeated decoder blocks, found from the model's own `_no_split_modules` (no per-arch code):
    the outermost modules of those classes (Mamba's list names its block and the mixer inside it), or,
    where the class names none (BioGPT, CTRL, RoBERTa's decoder), the one list of modules of a class
    under the decoder."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    # Through the MRO, so blocks are still found once FSDP has swapped in its FSDP<Block> subclass.
    found = {name: m for name, m in model.named_modules() if any(c.__name__ in names for c in type(m).__mro__)}
    blocks = [m for name, m in found.items() if not any(name.startswith(f"{outer}.") for outer in found)]
    if not blocks:
        lists = [children for children in decoder(model)[1].modules() if isinstance(children, nn.ModuleList)
                 and len(children) and len({type(child) for child in children}) == 1]
        blocks = list(lists[0]) if len(lists) == 1 else []
    if not blocks:
        raise UserError(f"{type(model).__name__}: cannot find its decoder blocks "
                        f"(_no_split_modules={sorted(names)}); this architecture is not supported")
    return blocks


_SUBCLASSES: dict[tuple[type, type], type] = {}


def become(module: nn.Module, ours: type) -> None:
    """Make `module` an instance of a subclass of its own class with `ours` first: its state, names
    and methods stay; `ours` overrides forward (our MoE blocks, tiled MLPs). One subclass per class,
    so every block of a model is of one class (one compiled graph)."""
    cls = type(module)
    if isinstance(module, ours):  # already ours (applied again)
        return
    if (ours, cls) not in _SUBCLASSES:
        _SUBCLASSES[ours, cls] = type(cls.__name__, (ours, cls), {"__module__": cls.__module__})
    module.__class__ = _SUBCLASSES[ours, cls]
