"""A base's identity, as a LoRA run's checkpoints and adapters record it: where the base comes from
and a fingerprint of its weights, so that adapters are never resumed, exported or served onto other
weights than those they were trained on without saying so."""

from __future__ import annotations

import hashlib
from pathlib import Path

from torch import nn

from sft.config import ModelConfig
from sft.hub.weights import SafetensorsWeights

# The fingerprint of a base's weights (weights_digest); "sha256:" before it was of the files
WEIGHTS_DIGEST = "weights-sha256:"


def weights_digest(weights: SafetensorsWeights) -> str:
    """A fingerprint of the weights, cheap at any size: every tensor's name, dtype and shape and
    128 bytes from its middle, by name (the headers `weights` parsed). Weights trained or replaced
    differ there in every tensor that changed; a copy, a move or another sharding of the same weights
    does not change it."""
    samples = []
    with weights.reading():
        for name, entry in weights.files.entries.items():
            middle = (entry.begin + entry.end) // 2
            samples.append((name, f"{entry.dtype_name}:{list(entry.shape)}",
                            weights.files.read_bytes(name, middle, min(128, entry.end - middle))))
    sha = hashlib.sha256()
    for name, kind, sample in sorted(samples):
        sha.update(f"{name}:{kind}:".encode() + sample)
    return WEIGHTS_DIGEST + sha.hexdigest()[:32]


def base_changed(recorded: str, current: str) -> bool:
    """Whether the base weights fingerprinted `current` (base_identity's `weights`) are not those a
    LoRA run `recorded`; only fingerprints of weights compare (not a random init's seed or a cache's
    path, nor the files' fingerprint that records before WEIGHTS_DIGEST hold)."""
    return recorded.startswith(WEIGHTS_DIGEST) and current != recorded


def base_identity(cfg: ModelConfig, seed: int, model: nn.Module, prepared: Path | None = None) -> dict[str, str]:
    """What a LoRA run's frozen base is, as its checkpoints record it: `base`, where it comes from
    (a local directory by its absolute path, so that an export names it from anywhere, or a hub id),
    and `weights`, a fingerprint that changes when the weights do (or the seed of a random init; the
    prepared-model cache the run loaded them from, by its path: `prepared`)."""
    path = Path(cfg.name_or_path).expanduser()
    base = str(path.resolve()) if path.is_dir() else cfg.name_or_path
    if prepared is not None:
        return {"base": base, "weights": f"model.prepared_cache={prepared.resolve()}"}
    if cfg.init != "pretrained":
        return {"base": base, "weights": f"random init, train.seed={seed}"}
    return {"base": base, "weights": weights_digest(SafetensorsWeights(cfg.name_or_path, model))}
