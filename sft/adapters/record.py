"""What a LoRA run's adapters are trained on, as its checkpoints' train state records it (`lora`): the
base (where it comes from, a fingerprint of its weights) and the adapters' rank, alpha and targets;
and the check at resume, which refuses another base or scale unless asked. The LoRA handle's
`record` and `check_resume` (sft/adapters/lora.py) are what the checkpoint manager calls."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from sft.config import LoRAConfig, ModelConfig
from sft.distributed import log0
from sft.errors import UserError
from sft.hub.identity import base_identity

LEGACY_DIGEST = "sha256:"  # the fingerprint of a base's files (sharding and all) that checkpoints recorded before


class AdapterResumeError(UserError):
    """A LoRA checkpoint cannot resume onto this run's base or adapters; the message names the fix."""


def adapters_record(model_cfg: ModelConfig, cfg: LoRAConfig, targets: list[str], seed: int, model: nn.Module,
                    prepared: Path | None) -> dict:
    """The record of a run's adapters (rank 0 reads the base's files: sft/hub/identity.py:base_identity;
    `prepared`: the prepared-model cache the base was loaded from, if it was)."""
    return {**base_identity(model_cfg, seed, model, prepared), "rank": cfg.rank, "alpha": cfg.alpha,
            "target_modules": targets}


def lora_change_problem(path: Path, saved: dict | None, ours: dict, allowed: bool) -> None:
    """Refuse (AdapterResumeError) to resume the LoRA checkpoint `path`, whose train state records
    `saved`, onto a base or a scale (`ours`) other than those its adapters were trained with, unless
    `allowed`; or with adapters of another shape, which cannot load. A checkpoint from before the
    record existed is taken as it is."""
    if saved is None:
        return
    shape = ("rank", "target_modules")
    if any(saved[key] != ours[key] for key in shape):
        raise AdapterResumeError(
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
        raise AdapterResumeError(
            f"{path} was trained on another base or scale than this run's ({'; '.join(changed)}): resume with the "
            "base and lora.alpha it was trained with, start fresh with checkpoint.resume=none, or set "
            "lora.allow_resume_change=true to train these adapters on this base anyway")
    if changed:
        log0(f"warning: resuming {path} with {'; '.join(changed)} (lora.allow_resume_change=true)")
