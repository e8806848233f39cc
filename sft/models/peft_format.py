"""PEFT's LoRA adapter format, as sft.export writes it and sft.chat reads it: adapter_config.json
and adapter_model.safetensors with tensors named `base_model.model.<module>.lora_A.weight` /
`lora_B.weight` (and modules trained in full by their own names), merged as W + (lora_alpha / r) B A.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sft.config import LoRAConfig
from sft.errors import UserError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """(alpha / r) B A in float32: what an adapter adds to its base weight when merged."""
    return (scaling * lora_b.float()) @ lora_a.float()


def merged(name: str, weight: torch.Tensor, trained: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
    """Parameter `name` of the base (`weight`) with the adapter merged in, from `trained` (the
    adapters and the modules trained in full, by model name): a module trained in full as trained,
    an adapted weight W + scaling B A in float32, anything else as it is."""
    if name in trained:
        return trained[name]
    stem = name.removesuffix(".weight")
    if f"{stem}.lora_A.weight" in trained:
        delta = adapter_delta(trained[f"{stem}.lora_A.weight"], trained[f"{stem}.lora_B.weight"], scaling)
        return weight.float() + delta
    return weight


def write_adapter(out: Path, trained: dict[str, torch.Tensor], lora: LoRAConfig, base: str, tied: bool) -> None:
    """Write `trained` (by model name) as PEFT's adapter of `base` into the directory `out`. `tied`: a
    trained embedding is the lm_head too (`trained` holds both), which PEFT keeps tied when told so
    (ensure_weight_tying) and reads from both names."""
    save_file({PREFIX + name: tensor.contiguous() for name, tensor in trained.items()}, out / WEIGHTS_FILE,
              metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "target_modules": sorted({name.split(".lora_")[0].rsplit(".", 1)[1] for name in trained if is_adapter(name)}),
        "modules_to_save": lora.modules_to_save or None,
        "ensure_weight_tying": tied,
        "base_model_name_or_path": base,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor], float]:
    """A PEFT LoRA adapter: (adapter_config.json, its tensors by model name, its scaling); a damaged
    file is one UserError."""
    try:
        config = json.loads((adapter_dir / CONFIG_FILE).read_text())
        tensors = load_file(adapter_dir / WEIGHTS_FILE)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{adapter_dir}: the adapter cannot be read ({' '.join(str(e).split())}): export it again "
                        "(python -m sft.export CHECKPOINT NEW_DIR)") from None
    scaling = LoRAConfig(rank=config["r"], alpha=config["lora_alpha"]).scaling
    return config, {name.removeprefix(PREFIX): tensor for name, tensor in tensors.items()}, scaling
