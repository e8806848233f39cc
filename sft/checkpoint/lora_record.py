"""What a LoRA checkpoint's adapters were trained on, as its train state records it (`lora`): the
base (where it comes from, a fingerprint of its weights) and the adapters' rank, alpha and targets;
and the check at resume, which refuses another base or scale unless asked."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from sft.adapters.lora import LoRA
from sft.checkpoint.layout import CheckpointError
from sft.config import ModelConfig
from sft.distributed import log0
from sft.hub.identity import base_identity

LEGACY_DIGEST = "sha256:"  # the fingerprint of a base's files (sharding and all) that checkpoints recorded before


def lora_record(model_cfg: ModelConfig, lora: LoRA, seed: int, model: nn.Module, prepared: Path | None) -> dict:
    """The record of a run's adapters (rank 0 reads the base's files: sft/hub/weights.py:base_identity;
    `prepared`: the prepared-model cache the base was loaded from, if it was)."""
    return {**base_identity(model_cfg, seed, model, prepared), "rank": lora.cfg.rank, "alpha": lora.cfg.alpha,
            "target_modules": lora.targets}


def lora_change_problem(path: Path, saved: dict | None, ours: dict, allowed: bool) -> None:
    """Refuse (CheckpointError) to resume the LoRA checkpoint `path`, whose train state records
    `saved`, onto a base or a scale (`ours`) other than those its adapters were trained with, unless
    `allowed`; or with adapters of another shape, which cannot load. A checkpoint from before the
    record existed is taken as it is."""
    if saved is None:
        return
    shape = ("rank", "target_modules")
    if any(saved[key] != ours[key] for key in shape):
        raise CheckpointError(
            f"{path} holds rank-{saved['rank']} adapters on {', '.join(saved['target_modules'])}, this run asks for "
            f"rank {ours['rank']} on {', '.join(ours['target_modules'])}: set lora.rank and lora.target_modules as "
            "the checkpoint has, or start fresh with checkpoint.resume=none")
    changed = []
    if saved["weights"].startswith(LEGACY_DIGEST) and saved["weights"] != ours["weights"]:
        log0(f"warning: {path} records its base's files, not their weights (an older checkpoint): the base is not "
             "compared")
    elif saved["weights"] != ours["weights"]:
        changed.append(f"base {saved['base']} ({saved['weights']}) -> {ours['base']} ({ours['weights']})")
    if saved["alpha"] != ours["alpha"]:
        changed.append(f"lora.alpha {saved['alpha']} -> {ours['alpha']}")
    if changed and not allowed:
        raise CheckpointError(
            f"{path} was trained on another base or scale than this run's ({'; '.join(changed)}): resume with the "
            "base and lora.alpha it was trained with, start fresh with checkpoint.resume=none, or set "
            "lora.allow_resume_change=true to train these adapters on this base anyway")
    if changed:
        log0(f"warning: resuming {path} with {'; '.join(changed)} (lora.allow_resume_change=true)")
