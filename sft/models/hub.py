"""The Hugging Face hub's file layout: sharded safetensors written as transformers writes them, and
the experts of mixture-of-experts models, which transformers 5 fuses into one tensor per block but
whose hub files (and exports) hold one tensor per expert. Loading (sft/models/weights.py) and
export (sft/export.py) both go through here."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator
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


@functools.cache
def hub_layout(model_type: str) -> tuple[str, str, str, str] | None:
    """How the fused expert parameters map to the hub's per-expert tensors, for the architectures
    whose hub files hold one tensor per expert: (the block's name in the files where it is not
    `mlp`, gate, up, down names); None where the files hold them fused (gpt-oss). Read from the
    renamings transformers itself applies when it loads the files (its conversion mapping), so every
    family it ships is covered as it covers it."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        transforms = get_checkpoint_conversion_mapping(model_type) or []
    except ImportError:  # a transformers without conversion mappings: fused in the files
        return None
    block, names = "", {}
    for transform in transforms:  # their patterns are regular expressions: literal names where escaped
        sources, targets = ([re.sub(r"\\(.)", r"\1", p) for p in patterns]
                            for patterns in (transform.source_patterns, transform.target_patterns))
        if targets == [".mlp."] and len(sources) == 1:  # e.g. Mixtral's .block_sparse_moe.
            block = sources[0].strip(".")
        elif len(targets) == 1 and targets[0].endswith(("experts.gate_up_proj", "experts.down_proj")):
            names[targets[0].rpartition(".")[2]] = [s.rpartition("experts.*.")[2].removesuffix(".weight")
                                                    for s in sources]
    if len(names.get("gate_up_proj", ())) != 2 or len(names.get("down_proj", ())) != 1 or not all(
            re.fullmatch(r"\w*", n) for n in (block, *names["gate_up_proj"], *names["down_proj"])):
        return None  # not plain names of this form: left fused (check() says what the files lack)
    (gate, up), (down,) = names["gate_up_proj"], names["down_proj"]
    return block, gate, up, down


def _expert_names(layout: tuple, name: str, expert: int) -> tuple[str, ...]:
    """Hub names of expert `expert`'s tensors behind fused parameter `name` (gate_up_proj: gate, up)."""
    rename, gate, up, down = layout
    prefix = name.rpartition(".experts.")[0]
    if rename:
        prefix = prefix.replace(".mlp", f".{rename}")
    base = f"{prefix}.experts.{expert}"
    if name.endswith("gate_up_proj"):
        return f"{base}.{gate}.weight", f"{base}.{up}.weight"
    return (f"{base}.{down}.weight",)


def is_fused_expert(name: str) -> bool:
    return name.endswith((".experts.gate_up_proj", ".experts.down_proj"))


# A dense layer's MLP (Kimi-Linear's first layers), which keeps its name where sparse blocks are renamed.
_DENSE_MLP = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.")


def hub_name(model_type: str, name: str) -> str:
    """The hub name of a non-expert tensor (Mixtral's and MiniMax-M2's sparse blocks, their router
    and bias included, live under block_sparse_moe)."""
    layout = hub_layout(model_type)
    if layout and layout[0] and ".mlp." in name and not _DENSE_MLP.search(name):
        return name.replace(".mlp.", f".{layout[0]}.")
    return name


def hub_shapes(model_type: str, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The hub tensors that hold parameter `name` (of `shape`), with their shapes."""
    layout = hub_layout(model_type)
    if layout is None or not is_fused_expert(name):
        return {hub_name(model_type, name): tuple(shape)}
    experts, rows, cols = shape
    out = {}
    for e in range(experts):
        names = _expert_names(layout, name, e)
        out.update({hub: (rows // len(names), cols) for hub in names})
    return out


def read_fused_slice(read, model_type: str, name: str, shape: tuple[int, ...],
                     index: tuple[slice, ...]) -> torch.Tensor:
    """Slice `index` of fused expert parameter `name` (full `shape`) assembled from the hub's
    per-expert tensors, reading only the experts and rows in it (`read(hub name, index)`). The
    index may leave dims or bounds out (the whole tensor: `()`, `slice(None)`), as any tensor's may."""
    layout = hub_layout(model_type)
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    experts, rows, cols = (slice(*part.indices(size)[:2]) for part, size in zip(index, shape))
    parts = []
    for e in range(experts.start, experts.stop):
        names = _expert_names(layout, name, e)
        per = shape[1] // len(names)  # gate_up_proj: rows [0, I) are the gate's, [I, 2I) the up projection's
        pieces = [read(hub, (slice(max(rows.start, i * per) - i * per, min(rows.stop, (i + 1) * per) - i * per), cols))
                  for i, hub in enumerate(names) if max(rows.start, i * per) < min(rows.stop, (i + 1) * per)]
        parts.append(torch.cat(pieces))
    return torch.stack(parts) if parts else torch.empty((0, rows.stop - rows.start, cols.stop - cols.start))


def quantized_experts_problem(source: str, names: Iterable[str]) -> str | None:
    """One line for hub files whose experts are MXFP4 (gpt-oss as published: *_blocks/*_scales),
    which train from bf16: how to dequantise them once."""
    if not any(name.endswith((".experts.gate_up_proj_blocks", ".experts.down_proj_blocks")) for name in names):
        return None
    return (f"model.name_or_path={source!r} holds MXFP4-quantised experts (gpt-oss as published); training needs "
            "them in bf16: dequantise once with transformers (python -c \"from transformers import "
            "AutoModelForCausalLM, Mxfp4Config; AutoModelForCausalLM.from_pretrained('SOURCE', dtype='bfloat16', "
            "quantization_config=Mxfp4Config(dequantize=True)).save_pretrained('OUT')\") and set model.name_or_path "
            "to OUT")


def to_hub_tensors(model_type: str, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs as the hub stores them: fused experts split per expert."""
    layout = hub_layout(model_type)
    for name, tensor in named:
        if layout is None or not is_fused_expert(name):
            yield hub_name(model_type, name), tensor
            continue
        for e in range(tensor.shape[0]):
            names = _expert_names(layout, name, e)
            for hub, part in zip(names, tensor[e].chunk(len(names))):
                yield hub, part.contiguous()
