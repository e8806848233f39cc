"""The Hugging Face hub's file layout: how a model's tensors sit in the safetensors files that
transformers saves and checkpoints are published in, and those files written as transformers
writes them. Loading (sft/hub/weights.py) reads through here and export (sft/export.py) writes
through here.

transformers' own conversion mapping (transformers/conversion_mapping.py, what `from_pretrained`
applies and `save_pretrained` reverts) is the source of truth for every family it ships. The files
may name a tensor otherwise than the model (Mixtral's `block_sparse_moe`, gpt-neox's `embed_out`,
OLMo-hybrid's norms). They may hold one tensor per expert where the model fuses them, q/k/v
convolutions that the model concatenates (Kimi-Linear, OLMo-hybrid), or one q/k/v projection that
the model splits (Sarvam-MoE). A vision-language checkpoint's own conversions of its language
model's tensors apply too (GLM-4.5V's experts one tensor each, Qwen3-VL-MoE's transposed).

A rank reads only its own slice of a tensor stacked from one per expert (expert by expert),
concatenated from several (piece by piece) or transposed; a tensor made otherwise (split,
interleaved) is assembled whole on each rank, then sliced.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

# The largest safetensors shard written (Hugging Face's own default size).
MAX_SHARD_BYTES = 5 * 2**30


def is_adapter(name: str) -> bool:
    """Whether tensor `name` is a LoRA adapter's (lora_A/lora_B, as PEFT names them), which no base
    checkpoint holds."""
    return ".lora_A" in name or ".lora_B" in name


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


@contextlib.contextmanager
def _classes_as_built(model: nn.Module) -> Iterator[None]:
    """`model` with the classes it was built with: FSDP2 gives each module it shards a subclass of
    its own ("FSDPGPTNeoXForCausalLM"), and transformers finds some mappings by class name."""
    from torch.distributed.fsdp import FSDPModule

    wrapped = [(module, type(module)) for module in model.modules() if isinstance(module, FSDPModule)]
    try:
        for module, cls in wrapped:
            module.__class__ = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
        yield
    finally:
        for module, cls in wrapped:
            module.__class__ = cls


def _transforms(model: nn.Module, loading: bool, vision_language: tuple[str, str] | None) -> tuple[list, list]:
    """(renamings, converters) of `model` in transformers' conversion mapping: as `from_pretrained`
    applies them (`loading`, its legacy renamings included), or reversed, as `save_pretrained`
    writes a model it did not load. `vision_language`: the class and model type of the
    vision-language checkpoint that `model` is the language model of, whose converters apply to the
    language model's tensors too (its renamings move prefixes: sft/models/vision_language.py does)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter

    with _classes_as_built(model):
        transforms = get_model_conversion_mapping(model, add_legacy=loading)
    if vision_language:
        own = next((found for name in vision_language if (found := get_checkpoint_conversion_mapping(name))), [])
        transforms += [t for t in own if isinstance(t, WeightConverter)]
    if not loading:  # a prefix change cannot be told apart once undone: save_pretrained leaves it out too
        transforms = [t.reverse_transform() for t in transforms[::-1] if not isinstance(t, PrefixChange)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return [t for t in transforms if not isinstance(t, WeightConverter)], converters


class _Shapes:
    """What transformers' operations ask of the model they convert for (a Split sizes its parts by
    the parameters'), without touching the model itself (sharded, wrapped)."""

    def __init__(self, config, shapes: dict[str, tuple[int, ...]]):
        self.config, self.shapes = config, shapes

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty(self.shapes[name], device="meta")


@dataclass
class _Group:
    """The files' tensors that make some of the model's: by the converter's source pattern, in the
    files' natural order (expert 0, 1, ...); `converter` None for one tensor under its own name or another."""
    converter: object | None
    sources: dict[str, list[str]] = field(default_factory=dict)

    def file_names(self) -> list[str]:
        return [name for names in self.sources.values() for name in names]


class FileLayout:
    """Where each of a model's tensors (parameters and persistent buffers, `shapes`) is in a
    checkpoint's files (`file_shapes`, named as the model would name them: a vision-language
    checkpoint's prefix already taken off), as transformers' `from_pretrained` would find it."""

    def __init__(self, model: nn.Module, shapes: dict[str, tuple[int, ...]], file_shapes: dict[str, tuple[int, ...]],
                 vision_language: tuple[str, str] | None = None):
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        renamings, converters = _transforms(model, loading=True, vision_language=vision_language)
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        prefix = getattr(model, "base_model_prefix", "")
        self.model = _Shapes(model.config, shapes)
        self.file_shapes = file_shapes
        groups: dict[str, _Group] = {}
        for key in sorted(file_shapes, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, shapes)
            if target not in shapes and key in shapes:  # as from_pretrained: a name the model has is not renamed
                target, pattern = key, None
            if target not in shapes:
                continue  # not the model's (a vision tower, a multi-token-prediction head): kept or ignored
            group = groups.setdefault(target, _Group(by_pattern[pattern] if pattern else None))  # (copied to convert)
            if group.converter is None and group.sources:
                continue  # a second tensor for the same name (embed_out and lm_head): the first counts, as there
            group.sources.setdefault(pattern or key, []).append(key)
        # What each group gives, found by converting empty tensors of the files' shapes
        self.groups: dict[str, tuple[str, _Group]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for first, group in groups.items():
            made = self._convert(first, group, lambda name: torch.empty(file_shapes[name], device="meta"))
            for name, tensor in made.items():
                self.groups[name] = (first, group)
                self.shapes[name] = tuple(tensor.shape)
        self._last: tuple[str, dict[str, torch.Tensor]] | None = None  # the last group assembled whole
        self._converting = threading.Lock()

    def _convert(self, first: str, group: _Group, load: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's tensors that `group` makes, from the files' tensors `load` gives."""
        if group.converter is None:
            ((name,),) = group.sources.values()
            return {first: load(name)}
        converter = copy.deepcopy(group.converter)
        for pattern, names in group.sources.items():
            for name in names:
                converter.add_tensor(first, name, pattern, lambda name=name: load(name))
        made = converter.convert(first, model=self.model, config=self.model.config)
        return {name: tensor[0] if isinstance(tensor, list) else tensor for name, tensor in made.items()}

    def sources(self, name: str) -> list[str]:
        """The files' tensors that model tensor `name` is made of."""
        return self.groups[name][1].file_names()

    def read(self, read: Callable[[str, tuple[slice, ...]], torch.Tensor], name: str,
             index: tuple[slice, ...]) -> torch.Tensor:
        """Slice `index` of model tensor `name`, from the files' tensors (`read(file name, index)`)."""
        first, group = self.groups[name]
        if group.converter is None:
            return read(group.file_names()[0], index)
        index = tuple(index) + (slice(None),) * (len(self.shapes[name]) - len(index))
        index = tuple(slice(*part.indices(size)[:2]) for part, size in zip(index, self.shapes[name]))
        patterns = [p for p in group.converter.source_patterns if p in group.sources]  # in the converter's order
        if _stacks_experts(group.converter):
            experts, rows, cols = index
            parts = [self._read_pieces(read, [group.sources[p][e] for p in patterns], 0, (rows, cols))
                     for e in range(experts.start, experts.stop)]
            return torch.stack(parts) if parts else torch.empty((0, rows.stop - rows.start, cols.stop - cols.start))
        if (dim := _concatenates(group.converter)) is not None:
            return self._read_pieces(read, [file for p in patterns for file in group.sources[p]], dim, index)
        if (dims := _transposes(group.converter)) is not None:  # Qwen3-VL-MoE's experts as published
            (file,), (d0, d1, where_shapes_differ) = group.file_names(), dims
            if where_shapes_differ and self.file_shapes[file] == self.shapes[name]:
                return read(file, index)
            swapped = list(index)
            swapped[d0], swapped[d1] = index[d1], index[d0]
            return read(file, tuple(swapped)).transpose(d0, d1)
        with self._converting:  # q, k and v of one split come from one conversion, made once (threads read them)
            if self._last is None or self._last[0] != first:
                self._last = first, self._convert(first, group, lambda file: read(file, ...))
            return self._last[1][name][index]

    def _read_pieces(self, read, files: list[str], dim: int, index: tuple[slice, ...]) -> torch.Tensor:
        """Slice `index` of the concatenation of `files` along `dim`, reading only the pieces in it."""
        wanted, pieces, begin = index[dim], [], 0
        for file in files:
            end = begin + self.file_shapes[file][dim]
            if max(wanted.start, begin) < min(wanted.stop, end) or (not pieces and end >= wanted.stop):
                part = slice(max(wanted.start, begin) - begin, max(min(wanted.stop, end) - begin, 0))
                pieces.append(read(file, index[:dim] + (part,) + index[dim + 1:]))
            begin = end
        return torch.cat(pieces, dim)


def _concatenates(converter) -> int | None:
    """The dimension along which `converter` only concatenates the files' tensors (q/k/v
    convolutions, an embedding kept in shards), None where it does more."""
    from transformers.core_model_loading import Concatenate

    ops = converter.operations
    return ops[0].dim if len(ops) == 1 and type(ops[0]) is Concatenate else None


def _transposes(converter) -> tuple[int, int, bool] | None:
    """The two dimensions that `converter` only swaps, and whether only where the shapes differ from
    the model's; None where it does more."""
    from transformers.core_model_loading import Transpose

    ops = converter.operations
    if len(ops) != 1 or type(ops[0]) is not Transpose or len(converter.source_patterns) != 1:
        return None
    return ops[0].dim0, ops[0].dim1, getattr(ops[0], "check_dims", False)


def _stacks_experts(converter) -> bool:
    """Whether `converter` stacks one 2-D tensor per expert into a 3-D one, concatenating the tensors
    of each expert's row by row where there are several (gate and up), in its source patterns' order."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = converter.operations
    return (isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
            and all(isinstance(op, Concatenate) and op.dim == 1 for op in ops[1:]) and len(ops) <= 2)


def to_hub_tensors(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]],
                   vision_language: tuple[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's (name, tensor) pairs as `save_pretrained` writes them: transformers' conversion
    mapping reverted (`vision_language`: as FileLayout's), tensor by tensor (those a conversion needs
    together, e.g. q, k and v that the files hold as one, are held until the last of them comes)."""
    renamings, converters = _transforms(model, loading=False, vision_language=vision_language)
    renamed = _renamed_by(renamings)

    def converted(first: str, converter) -> Iterator[tuple[str, torch.Tensor]]:
        made = converter.convert(first, model=model, config=model.config)
        for name, tensor in made.items():
            yield renamed(name), (tensor[0] if isinstance(tensor, list) else tensor)

    pending: dict[str, object] = {}
    for name, tensor in named:
        for template in converters:
            first, pattern = template.rename_source_key(name)
            if pattern is not None:
                break
        else:
            yield renamed(name), tensor
            continue
        converter = pending.setdefault(first, copy.deepcopy(template))
        converter.add_tensor(first, name, pattern, tensor)
        if all(p in converter.collected_tensors and "*" not in p for p in converter.source_patterns):
            yield from converted(first, pending.pop(first))
    for first, converter in pending.items():
        yield from converted(first, converter)


def _renamed_by(renamings: list) -> Callable[[str], str]:
    def renamed(name: str) -> str:
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        return name
    return renamed


def renamer(model: nn.Module, loading: bool) -> Callable[[str], str]:
    """A name as transformers' renamings of `model` change it: a model name as `save_pretrained`
    writes it, or (`loading`) a files' name as `from_pretrained` reads it (no conversion of tensors:
    for tensors of the model's shapes, such as LoRA adapters of its layers, which PEFT names so)."""
    return _renamed_by(_transforms(model, loading=loading, vision_language=None)[0])


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
