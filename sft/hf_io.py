"""Writing Hugging Face checkpoints: sharded safetensors + index, streamed (commit the directory
with sft.atomic.directory)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

# The largest safetensors shard written (Hugging Face's own default size).
MAX_SHARD_BYTES = 5 * 2**30


def write_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], directory: Path,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write (name, tensor) pairs as model-0000i-of-0000n.safetensors + model.safetensors.index.json.

    Tensors are consumed one at a time and a shard is written as soon as it is full, so host
    memory stays bounded by one shard whatever the model size.
    """
    shard_names: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0

    def flush() -> None:
        save_file(shard, directory / f"part-{len(shard_names)}.safetensors", metadata={"format": "pt"})
        shard_names.append(list(shard))
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[name] = tensor.detach().contiguous().cpu()
        shard_bytes += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, names in enumerate(shard_names):
        final = f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors"
        (directory / f"part-{i}.safetensors").rename(directory / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
