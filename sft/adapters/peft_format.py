"""PEFT's LoRA adapter format, as sft.export writes it and sft.chat reads it: adapter_config.json
and adapter_model.safetensors with tensors named `base_model.model.<module>.lora_A.weight` /
`lora_B.weight` (and modules trained in full by their own names), merged as W + (lora_alpha / r) B A.
The module names are those `save_pretrained` writes (transformers' renamings reverted: Laguna's
`shared_expert`, Mixtral's `block_sparse_moe`), which PEFT renames as transformers renames the
base's tensors when it loads the adapter. adapter_config.json also records the fingerprint of the
base's weights the adapter was trained on (`sft_base_weights`; PEFT ignores it).

Adapters of routed experts are PEFT's `target_parameters` (its ParamWrapper, peft >= 0.17): one
wrapper per fused weight of the experts module, nested in the order the module defines its weights
(the innermost first, `experts.base_layer.lora_A.weight` for gate_up_proj, `experts.lora_A.weight`
for down_proj); lora_A [E r, in] holds expert e's A in rows e r ... (e + 1) r - 1, and lora_B
[out, r E] expert e's B in columns e, E + e, ... (rank-major). Ours are [E, r, in] and [E, out, r]
(sft/adapters/lora.py: ExpertLoRA). PEFT's wrapper has no dropout: the exported config says 0, as
inference (inference_mode) does anyway (so does PEFT's wrapper of a Linear weight, below).

PEFT on transformers 5 reads the Linear names `gate_proj`, `up_proj`, `down_proj` (`w1`-`w3` for
Mixtral's kind) in the `target_modules` of an MoE family whose experts transformers 5 fused as the
experts of transformers 4: it adapts the fused experts at twice the rank instead and leaves those
Linear layers (DeepSeek-V3's shared experts and dense MLPs) without their adapters. For such a family
the export names these layers as parameters (`target_parameters: [gate_proj.weight, ...]`), which
PEFT adapts with the same tensors and the same W + (lora_alpha / r) B A (peft 0.21).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sft.config import LoRAConfig
from sft.errors import UserError
from sft.hub.layout import is_adapter, renamer
from sft.models.experts import EXPERT_WEIGHTS

CONFIG_FILE = "adapter_config.json"
BASE_WEIGHTS = "sft_base_weights"  # adapter_config.json: the fingerprint of the base's weights (sft/hub/identity.py)
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


# An expert adapter's parameter, by model name: (experts module).(fused weight)_lora.lora_(A|B)
_EXPERT_ADAPTER = re.compile(r"(.+)\.(\w+)_lora\.lora_([AB])")


def adapter_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """(alpha / r) B A in float32: what an adapter adds to its base weight when merged."""
    return (scaling * lora_b.float()) @ lora_a.float()


def merged(name: str, weight: torch.Tensor, trained: dict[str, torch.Tensor], scaling: float,
           model: torch.nn.Module) -> torch.Tensor:
    """Parameter `name` of the base (`weight`) of `model` with the adapter merged in, from `trained`
    (the adapters and the modules trained in full, by model name): a module trained in full as
    trained, an adapted weight W + scaling B A in float32 (a fused expert weight: each expert's,
    transposed where the model stores it so), anything else as it is."""
    if name in trained:
        return trained[name]
    stem = name.removesuffix(".weight")
    if f"{stem}.lora_A.weight" in trained:
        delta = adapter_delta(trained[f"{stem}.lora_A.weight"], trained[f"{stem}.lora_B.weight"], scaling)
        return weight.float() + delta
    if f"{name}_lora.lora_A" in trained:
        delta = adapter_delta(trained[f"{name}_lora.lora_A"], trained[f"{name}_lora.lora_B"], scaling)  # [E, out, in]
        transposed = model.get_submodule(name.rpartition(".")[0]).is_transposed
        return weight.float() + (delta.transpose(-2, -1) if transposed else delta)
    return weight


def unmatched(trained: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """The names in `trained` that `merged` would find no parameter of `model` for (an adapter of
    another model), sorted."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}

    def target(name: str) -> str:
        if match := _EXPERT_ADAPTER.fullmatch(name):
            return f"{match.group(1)}.{match.group(2)}"
        return name.split(".lora_")[0] + ".weight" if is_adapter(name) else name

    return sorted(name for name in trained if target(name) not in names)


def _to_peft(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """An adapter tensor by PEFT's name and in its layout (see the module's docstring)."""
    if not (match := _EXPERT_ADAPTER.fullmatch(name)):
        return name, tensor
    module, weight, factor = match.groups()
    nesting = ".base_layer" * (len(EXPERT_WEIGHTS) - 1 - EXPERT_WEIGHTS.index(weight))
    if factor == "A":  # [E, r, in] -> [E r, in]
        return f"{module}{nesting}.lora_A.weight", tensor.reshape(-1, tensor.shape[-1])
    return f"{module}{nesting}.lora_B.weight", tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)  # -> [out, r E]


def _from_peft(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (by model name, PEFT's nesting) by our names, in our layout."""
    targets = config.get("target_parameters") or []
    ours = {}
    for name, tensor in tensors.items():
        module, factor = name.removesuffix(".weight").rsplit(".lora_", 1) if is_adapter(name) else (name, "")
        depth = module.count(".base_layer")
        module = module.replace(".base_layer", "")
        adapted = [w for w in EXPERT_WEIGHTS if any(f".{module}.{w}".endswith(f".{t}") for t in targets)]
        if not adapted:
            ours[name] = tensor
            continue
        weight, rank = adapted[len(adapted) - 1 - depth], config["r"]
        if factor == "A":  # [E r, in] -> [E, r, in]
            ours[f"{module}.{weight}_lora.lora_A"] = tensor.reshape(-1, rank, tensor.shape[-1])
        else:  # [out, r E] -> [E, out, r]
            ours[f"{module}.{weight}_lora.lora_B"] = tensor.reshape(tensor.shape[0], rank, -1).permute(2, 0, 1)
    return ours


# transformers' conversion pattern of a family -> the Linear names PEFT takes for its v4 experts (its
# _MOE_TARGET_MODULE_MAPPING, peft 0.21.2; Mixtral's kind is its own pattern there)
_PEFT_V4_EXPERT_NAMES = {"qwen2_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w2", "w3")}


def _peft_v4_expert_names(model_type: str) -> tuple[str, ...]:
    """The Linear names PEFT would take for the transformers 4 experts of a `model_type` model."""
    from transformers import conversion_mapping

    patterns = getattr(conversion_mapping, "_MODEL_TO_CONVERSION_PATTERN", {})
    return _PEFT_V4_EXPERT_NAMES.get(patterns.get(model_type, model_type), ())


def write_adapter(out: Path, trained: dict[str, torch.Tensor], lora: LoRAConfig, base: str, base_weights: str,
                  tied: bool, model: torch.nn.Module) -> None:
    """Write `trained` (by the names of `model`, the model of the base `base` whose weights'
    fingerprint is `base_weights`) as PEFT's adapter into the directory `out`. `tied`: a trained
    embedding is the lm_head too (`trained` holds both), which PEFT keeps tied when told so
    (ensure_weight_tying) and reads from both names."""
    hub_name = renamer(model, loading=False)
    save_file({PREFIX + hub_name(peft_name): peft_tensor.contiguous()
               for peft_name, peft_tensor in (_to_peft(name, tensor) for name, tensor in trained.items())},
              out / WEIGHTS_FILE, metadata={"format": "pt"})
    adapters = [name for name in trained if is_adapter(name)]
    experts = sorted({match.group(2) for name in adapters if (match := _EXPERT_ADAPTER.fullmatch(name))},
                     key=EXPERT_WEIGHTS.index)
    linear = sorted({name.split(".lora_")[0].rsplit(".", 1)[1] for name in adapters
                     if not _EXPERT_ADAPTER.fullmatch(name)})
    as_parameters = [name for name in linear if name in _peft_v4_expert_names(model.config.model_type)]  # docstring
    parameters = [f"experts.{weight}" for weight in experts] + [f"{name}.weight" for name in as_parameters]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": 0.0 if parameters else lora.dropout, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "target_modules": [name for name in linear if name not in as_parameters] or None,
        "target_parameters": parameters or None,
        "modules_to_save": lora.modules_to_save or None,
        "ensure_weight_tying": tied,
        "base_model_name_or_path": base,
        BASE_WEIGHTS: base_weights,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(adapter_dir: Path) -> dict:
    """A PEFT LoRA adapter's adapter_config.json; a damaged one is one UserError."""
    try:
        return json.loads((adapter_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise _damaged(adapter_dir, e) from None


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor], float]:
    """A PEFT LoRA adapter: (adapter_config.json, its tensors as the files name and lay them out, its
    scaling); a damaged file is one UserError. `in_model` makes the tensors a model's."""
    config = read_adapter_config(adapter_dir)
    try:
        tensors = load_file(adapter_dir / WEIGHTS_FILE)
    except (SafetensorError, OSError) as e:
        raise _damaged(adapter_dir, e) from None
    return config, tensors, LoRAConfig(rank=config["r"], alpha=config["lora_alpha"]).scaling


def in_model(tensors: dict[str, torch.Tensor], config: dict, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An adapter's tensors (read_adapter's) by the names of `model`, in our layout."""
    model_name = renamer(model, loading=True)
    return _from_peft({model_name(name.removeprefix(PREFIX)): tensor for name, tensor in tensors.items()}, config)


def _damaged(adapter_dir: Path, e: Exception) -> UserError:
    return UserError(f"{adapter_dir}: the adapter cannot be read ({' '.join(str(e).split())}): export it again "
                     "(python -m sft.export CHECKPOINT NEW_DIR)")
