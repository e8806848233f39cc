"""Memory-safe model construction: no rank ever holds a full copy of the weights. The model is built on
the meta device in float32 (the sharded master weights are float32 from the start: no whole-model cast),
buffers such as rotary `inv_freq` real (`parameters_on_meta`); after `fully_shard`, `materialize` gives
each rank storage for its own shards only, which sft/hub/weights.py fills."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from sft.config import ModelConfig, is_local_path
from sft.errors import UserError
from sft.models.architecture import text_config
from sft.models.layers import attention_kinds
from sft.models.vision_language import causal_class, is_vision_language, language_model_config, under_a_head

# What activation checkpointing inserts into parameter names (blocks are compiled in place,
# which adds nothing).
_AC_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


class ModelError(UserError):
    """The model or tokenizer cannot be used as configured; the message names the fix."""


def clean_name(name: str) -> str:
    """Parameter/buffer name as in the Hugging Face checkpoint (wrapper prefixes removed)."""
    return name.replace(_AC_WRAPPER_PREFIX, "")


# Local models that a make target writes (the LoRA demo's base): a missing one says how to make it.
MADE_BY = {"runs/demo_lora_base": "make demo-lora"}


def missing_local_dir(key: str, path: str) -> ModelError | None:
    """A clear error for a path that names a local directory that is not there (a hub id is
    'org/name'; anything else with a slash, or starting with . / ~, is a path)."""
    if is_local_path(path) and not Path(path).expanduser().is_dir():
        made_by = MADE_BY.get(Path(path).as_posix())
        return ModelError(f"{key}={path!r}: no such directory; " + (f"`{made_by}` writes it" if made_by else
                          "give an existing model directory or a hub id (e.g. Qwen/Qwen2.5-7B-Instruct)"))
    return None


def model_config(cfg: ModelConfig) -> PretrainedConfig:
    """model.name_or_path's config.json, or one line naming what to fix."""
    missing = missing_local_dir("model.name_or_path", cfg.name_or_path)
    if missing:
        raise missing
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"model.name_or_path={cfg.name_or_path!r}: could not load config.json ({reason}); give a "
                         "local model directory, or a hub name this machine can reach") from None


# What an architecture's class says of each attention implementation it can run.
_SUPPORTS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
             "flash_attention_2": "_supports_flash_attn", "flash_attention_3": "_supports_flash_attn"}


def runnable_attention(config: PretrainedConfig, wanted: str, cls: type[PreTrainedModel] | None = None) -> str:
    """`wanted` (model.attn_implementation) where the architecture can run it, else the first it can of
    sdpa, flex_attention (on GPUs: flex has no backward on CPUs) and eager, which every architecture
    has (gpt-oss: no SDPA, for its attention sinks; Qwen3.5 in transformers 5.17: no flex). Remote
    code: `wanted`, for transformers to judge. `cls`: the class built, where not transformers' causal one."""
    cls = cls or causal_class(config)
    if cls is None or getattr(cls, _SUPPORTS.get(wanted, ""), True):
        return wanted
    if cls._supports_sdpa:
        return "sdpa"
    return "flex_attention" if torch.cuda.is_available() and cls._supports_flex_attn else "eager"


def build_meta_model(cfg: ModelConfig, constructed_below: int = 0) -> PreTrainedModel:
    """The model with parameters on the meta device (float32) and real float32 buffers, its attention
    the configured one where the architecture can run it here (runnable_attention). Parameters of
    fewer than `constructed_below` elements stay real, as the constructor made them."""
    # A vision-language checkpoint: its language model (sft/models/vision_language.py)
    config = model_config(cfg)
    if is_vision_language(config) and cfg.init != "pretrained":  # the vision tower would have no weights to keep
        raise ModelError(f"model.init={cfg.init!r}: model.name_or_path={cfg.name_or_path!r} is a vision-language "
                         "checkpoint, trained on text from its pretrained weights; set model.init: pretrained, or "
                         "give a directory with its text config alone for a random language model")
    # its text model under a head of ours where transformers has no causal class for it (Qwen3-VL)
    head = under_a_head(config) if is_vision_language(config) else None
    try:
        config = language_model_config(config)
    except UserError as e:
        raise ModelError(f"model.name_or_path={cfg.name_or_path!r}: {e}") from None
    config.use_cache = False  # no KV cache while training (and packing relies on it being off)
    try:
        attention = runnable_attention(config, cfg.attn_implementation, head)
        with parameters_on_meta(constructed_below):
            if head is not None:
                model = head._from_config(config, dtype=torch.float32, attn_implementation=attention)
            else:
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention,
                                                         trust_remote_code=cfg.trust_remote_code)
    except (ValueError, ImportError) as e:  # transformers refuses the config, or the attention kernel here
        reason = " ".join(str(e).split())
        if "ttention" in reason:
            raise ModelError(f"model.attn_implementation={cfg.attn_implementation!r}: {reason}; use sdpa (or "
                             "flex_attention for packed rows, eager where neither runs)") from None
        raise ModelError(f"model.name_or_path={cfg.name_or_path!r}: transformers cannot build a model from its "
                         f"config.json ({reason})") from None
    if head is not None and any(getattr(m, "is_causal", True) is False for m in model.modules()):
        raise ModelError(f"model.name_or_path={cfg.name_or_path!r}: its text model ({head.__name__}) does not attend "
                         "causally, so it cannot be trained as a causal language model")
    model.tie_weights()  # from_config under init_empty_weights leaves tied embeddings as two tensors
    return model


# The name of transformers' SDPA attention under which transformers builds no mask (it builds masks
# only for the attention functions it knows).
CAUSAL_SDPA = "sft_causal_sdpa"


def use_causal_sdpa(model: PreTrainedModel, packing: bool) -> bool:
    """Rows of one sequence each (data.packing: false; pads come after the sequence and are never
    supervised) need no attention mask: SDPA's causal kernel is the whole mask. transformers would
    still look for packed sequences in position_ids, a check on the GPU's values that makes the host
    wait for the GPU at every forward (about 20 ms a step on P-7B, and the host can no longer queue
    a step ahead). Under another name transformers' own SDPA function runs without that check.
    Only for sdpa and models whose every layer attends fully (a sliding window needs its mask);
    return whether it did."""
    if packing or model.config._attn_implementation != "sdpa" or not attends_fully(model):
        return False
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    model.config._attn_implementation = CAUSAL_SDPA
    return True


def attends_fully(model: PreTrainedModel) -> bool:
    """Whether every layer of `model` that attends attends to the whole (causal) row: no sliding
    window, no soft cap of the attention logits (a hybrid's recurrent layers take no mask). Masks,
    causal-only kernels and context parallelism rely on it."""
    config = text_config(model.config)
    return (attention_kinds(config) <= {"full_attention"} and not getattr(config, "sliding_window", None)
            and not getattr(config, "attn_logit_softcapping", None))


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint holds besides the parameters (DeepSeek-V3's router correction bias;
    not rotary inv_freq, which is non-persistent), by their Hugging Face names."""
    return {clean_name(f"{module_name}.{name}".lstrip(".")): buffer
            for module_name, module in model.named_modules() for name, buffer in module._buffers.items()
            if buffer is not None and name not in module._non_persistent_buffers_set}


def real_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the (real, non-meta) buffers, to restore after `to_empty` overwrote them."""
    return {clean_name(n): b.detach().clone() for n, b in model.named_buffers()}



def materialize(model: nn.Module, buffers: dict[str, torch.Tensor], device: torch.device,
                offload: bool = False) -> None:
    """Allocate storage for this rank's shards on `device` (values undefined until load_weights or
    a checkpoint fills them) and restore the buffers."""
    # With CPU offload, FSDP keeps the shards in host memory.
    model.to_empty(device="cpu" if offload else device)
    # to_empty gives every parameter new storage, which unties tied embeddings on an unsharded
    # model (FSDP2 keeps one shared parameter); re-tie before loading so one tensor is filled.
    model.tie_weights()
    for module_name, module in model.named_modules():
        for name in list(module._buffers):
            if module._buffers[name] is not None:  # buffers are not sharded; they live on the device
                module._buffers[name] = buffers[clean_name(f"{module_name}.{name}".lstrip("."))].to(device)
    assert not any(p.is_meta for p in model.parameters()), "a parameter is still on the meta device"


@contextlib.contextmanager
def parameters_on_meta(constructed_below: int = 0) -> Iterator[None]:
    """Inside, every parameter a module registers moves to the meta device (no storage, no init
    work), while buffers are made as usual: real, so non-persistent ones such as rotary `inv_freq`,
    which no checkpoint holds, keep their values (pitfall: garbage after to_empty -> NaN). What
    accelerate.init_empty_weights does, without importing accelerate (which imports FSDP: the
    planner runs on login nodes)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.numel() >= constructed_below:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
