"""Filling this rank's shards: each rank reads only its own slice of each tensor, so no rank ever
holds a full copy of the weights.

* pretrained: straight from the safetensors files (sft/hub/safetensors_files.py: positional reads
  of a shard's rows, several threads at once), so each rank reads 1/world of the checkpoint and no
  collective is needed; tensors the files hold otherwise than the model (one per expert, renamed,
  q/k/v apart) converted as transformers converts them (sft/hub/layout.py), on the device;
* random: each parameter-holding module is initialised in full on the device by the
  architecture's own `_init_weights`, seeded by its name, one module at a time; the rank keeps its
  slice. The values are independent of the number of ranks.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import snapshot_download
from transformers import AutoConfig, AutoModelForImageTextToText
from safetensors.torch import save_file
from torch import nn

from sft.config import ModelConfig
from sft.distributed import local_slice, rank0_first
from sft.hub.layout import FileLayout, is_adapter, quantized_experts_problem
from sft.hub.safetensors_files import DamagedFile, SafetensorsFiles, UnsupportedDtype
from sft.hub.vision_language import KEPT, checkpoint_class, copy_processor_files, file_names, kept_names
from sft.models.architecture import decoder
from sft.models.build import (ModelError, build_meta_model, clean_name, missing_local_dir, model_config,
                              persistent_buffers, real_buffers)
from sft.models.nf4 import full_shape, is_nf4, quantized
from sft.models.vision_language import is_vision_language


# Tensors read at once (`read_many`), each read and copied onto the device by a thread of its own, as
# transformers' loader does (4 threads: more slow the page cache's reads down), and how many may be read
# ahead of the one being stored: device memory holds at most that many more.
READ_THREADS, READ_AHEAD = 4, 8


def _outside_language_model(whole: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of a vision-language model's parameters outside its language model (decoder and head)."""
    language_model = {id(p) for module in (whole.get_decoder(), whole.get_output_embeddings())
                      for p in module.parameters()}
    return {name: tuple(p.shape) for name, p in whole.named_parameters() if id(p) not in language_model}


class SafetensorsWeights:
    """Reads slices of named tensors from a Hugging Face safetensors checkpoint directory."""

    def __init__(self, directory: str, model: nn.Module):
        if missing := missing_local_dir("model.name_or_path", directory):
            raise missing
        root = Path(directory)
        if not root.is_dir():  # a hub id: the files are fetched once into the HF cache
            root = Path(snapshot_download(directory, allow_patterns=["*.safetensors", "*.json"]))
        self.source, self.root = directory, root
        index = root / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise self._damaged(DamagedFile(index.name, f"{type(e).__name__}: {e}")) from None
        elif (root / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ModelError(f"model.name_or_path={directory!r}: no model.safetensors(.index.json) there; "
                             "download the weights (huggingface-cli download) or set model.init: random")
        try:
            self.files = SafetensorsFiles(root, files)  # every header parsed once
        except DamagedFile as e:
            raise self._damaged(e) from None
        self.weight_map = {name: entry.file for name, entry in self.files.entries.items()}
        self.model = model
        self.shapes = {clean_name(n): tuple(_full_shape(model, n)) for n, _ in model.named_parameters()
                       if not is_adapter(n)}
        # The language model of a vision-language checkpoint sits under a prefix of the files' own
        # (sft/models/vision_language.py); the identity for a text model.
        self.file_shapes = {name: entry.shape for name, entry in self.files.entries.items()}
        self.names = file_names(self.file_shapes, decoder(model)[0], tuple(model.get_input_embeddings().weight.shape))

    @functools.cached_property
    def layout(self) -> FileLayout:
        """The files' tensors by the model's names, as transformers converts them (renamed, experts
        fused, q/k/v concatenated...: sft/hub/layout.py); not needed for a digest."""
        in_model = {self.names.in_model(name): shape for name, shape in self.file_shapes.items()}
        in_model.pop(None, None)
        buffers = {name: tuple(b.shape) for name, b in persistent_buffers(self.model).items()}
        return FileLayout(self.model, {**self.shapes, **buffers}, in_model, checkpoint_class(self.root))

    def _damaged(self, error: DamagedFile) -> ModelError:
        reason = " ".join(str(error).split())
        if isinstance(error, UnsupportedDtype):
            return ModelError(f"model.name_or_path={self.source!r}: {self.root / error.file}: {reason}")
        return ModelError(f"model.name_or_path={self.source!r}: {self.root / error.file} is damaged ({reason}); "
                          "download it again (huggingface-cli download), or give a complete model directory")

    def reading(self) -> contextlib.AbstractContextManager:
        """Within it, each file is opened once."""
        return self.files.reading()

    def kept(self) -> list[str]:
        """The files' tensors the model does not hold (a vision-language checkpoint's vision tower)."""
        trained = {self.names.of(source) for name in self.layout.groups for source in self.layout.sources(name)}
        return kept_names(self.weight_map, trained)

    def holds(self, name: str) -> bool:
        """Whether the files hold the model's tensor `name` (a buffer may be absent: its init stands)."""
        return name in self.layout.groups

    def read_as_stored(self, name: str) -> torch.Tensor:
        """Tensor `name` of the files, whole, in its stored dtype."""
        return self._from_files(name, ..., torch.device("cpu"))

    def check(self) -> None:
        """One clear error if the files lack a parameter of the model or hold it in another shape
        (weights of another architecture or size than their config.json), before any rank reads; the
        same for a vision-language checkpoint's vision tower (and projector), which the export keeps."""
        quantized = quantized_experts_problem(self.source, self.file_shapes)
        if quantized:
            raise ModelError(quantized)
        for part, expected, found in (("weights do", self.shapes, lambda: self.layout.shapes),
                                      ("vision tower does", *self._vision_tower())):
            wrong = [f"{name}: {shape} in the model of config.json, {found().get(name, 'absent')} in the files"
                     for name, shape in expected.items() if found().get(name) != shape]
            if wrong:
                raise ModelError(f"model.name_or_path={self.source!r}: its {part} not match its config.json "
                                 f"({len(wrong)} tensors differ, e.g. {wrong[0]}); give a directory whose "
                                 "safetensors and config.json belong together")

    def _vision_tower(self) -> tuple[dict[str, tuple[int, ...]], Callable[[], dict[str, tuple[int, ...]]]]:
        """(the shapes of a vision-language checkpoint's parameters outside its language model, as its
        class defines them; those the files give them, as transformers converts them); none for a text model."""
        if checkpoint_class(self.root) is None:
            return {}, dict
        config = AutoConfig.from_pretrained(self.root)
        if type(config) not in AutoModelForImageTextToText._model_mapping:  # no class to check against: kept as is
            return {}, dict
        with torch.device("meta"):
            whole = AutoModelForImageTextToText.from_config(config)
        shapes = _outside_language_model(whole)
        layout = functools.cache(lambda: FileLayout(whole, shapes, self.file_shapes).shapes)
        return shapes, layout

    def read_outside_language_model(self, whole: nn.Module) -> dict[str, torch.Tensor]:
        """The parameters of `whole`, the vision-language class of these files, outside its language
        model (the vision tower, the projector): whole, on the host, by the class's names, as
        transformers converts them from the files (Qwen2.5-VL's published visual.* among them)."""
        shapes = _outside_language_model(whole)
        layout = FileLayout(whole, shapes, self.file_shapes)
        if missing := sorted(set(shapes) - set(layout.groups)):
            raise ModelError(f"model.name_or_path={self.source!r}: the files lack {len(missing)} tensors of the vision "
                             f"tower (e.g. {missing[0]}), which images need")
        with self.reading():
            return {name: layout.read(lambda file, index: self._from_files(file, index, torch.device("cpu")), name, ())
                    for name in shapes}

    def read(self, name: str, index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        """Slice `index` of the model's tensor `name` (absent: a KeyError naming it; check() said so first).
        Each piece goes to `device` as it is read, and the conversion (experts stacked, q/k/v joined)
        runs there, as transformers' loader does."""
        return self.layout.read(functools.partial(self._read_file, device=device), name, index).to(device)

    def read_many(self, requests: Iterable[tuple[str, tuple[slice, ...]]], device: torch.device
                  ) -> Iterator[torch.Tensor]:
        """`read` of each (name, index), in order, READ_THREADS at a time and at most READ_AHEAD ahead
        of the one the caller holds (within `reading`). Onto the CPU one at a time: read ahead, the slices
        would wait in host memory, which then holds more than the rank's shards."""
        if device.type == "cpu":
            yield from (self.read(name, index, device) for name, index in requests)
            return
        self.layout  # noqa: B018 -- made once, before the threads
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="weights") as pool:
            pending: collections.deque = collections.deque()
            try:
                for name, index in requests:
                    pending.append(pool.submit(self.read, name, index, device))
                    if len(pending) > READ_AHEAD:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:  # closed early (an error where the reads go): the reads not begun are dropped
                for future in pending:
                    future.cancel()

    def _read_file(self, model_name: str, index, device: torch.device) -> torch.Tensor:
        """Slice `index` of the files' tensor that the model would call `model_name`, on `device`."""
        return self._from_files(self.names.of(model_name), index, device)

    def _from_files(self, file_name: str, index, device: torch.device) -> torch.Tensor:
        """Slice `index` of the files' tensor `file_name`, on `device`; a file shorter than its header says
        is one ModelError naming it."""
        try:
            return self.files.read(file_name, index, device)
        except DamagedFile as e:
            raise self._damaged(e) from None


# Parameters this small keep the value their module's constructor gave them where the architecture's
# _init_weights does not set them (a norm's weight of ones, an activation's learnt constants).
CONSTRUCTED_BELOW = 1 << 16


class RandomWeights:
    """The architecture's own random init, one module at a time, seeded by module name: its
    `_init_weights` of the module, then of the enclosing modules for what that leaves unset, then
    for a parameter still untouched the constructor's value (small parameters, built real:
    CONSTRUCTED_BELOW) or one error naming it (never uninitialised memory)."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.reference = build_meta_model(cfg, constructed_below=CONSTRUCTED_BELOW)
        self.buffers = real_buffers(self.reference)  # as the constructor made them
        self.constructed = {clean_name(n): p.detach().clone() for n, p in self.reference.named_parameters()
                            if not p.is_meta}
        self.seed = seed
        self._module_name: str | None = None

    def holds(self, name: str) -> bool:
        return True

    def reading(self) -> contextlib.AbstractContextManager:
        """As SafetensorsWeights.reading (no files here)."""
        return contextlib.nullcontext()

    def read_many(self, requests: Iterable[tuple[str, tuple[slice, ...]]], device: torch.device
                  ) -> Iterator[torch.Tensor]:
        """`read` of each (name, index), in order (one module at a time: no threads)."""
        return (self.read(name, index, device) for name, index in requests)

    def read(self, name: str, index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        if name in self.buffers:
            return self.buffers[name][index].to(device)
        module_name, _, param_name = name.rpartition(".")
        module = self.reference.get_submodule(module_name)
        if module_name != self._module_name:
            if self._module_name is not None:  # free the previous module's full tensors
                self.reference.get_submodule(self._module_name).to_empty(device="meta", recurse=False)
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                for param in module.parameters(recurse=False):
                    param.fill_(float("nan"))  # what _init_weights leaves untouched stays NaN
                torch.manual_seed(self.seed + zlib.crc32(module_name.encode()))
                self.reference._init_weights(module)
                self._init_from_enclosing_modules(module_name, module)
                for local, param in module.named_parameters(recurse=False):
                    unset = param.isnan()
                    if not unset.any():
                        continue
                    constructed = self.constructed.get(f"{module_name}.{local}")
                    if constructed is None or not unset.all():
                        raise ModelError(f"{type(self.reference).__name__}: its _init_weights leaves "
                                         f"{module_name}.{local} unset; use model.init: pretrained")
                    param.copy_(constructed)
            self._module_name = module_name
        return getattr(module, param_name).detach()[index]

    def _init_from_enclosing_modules(self, module_name: str, module: nn.Module) -> None:
        """Parameters of `module` its own _init_weights left unset, set by an enclosing module's, the
        nearest first, as from_config's walk over every module sets them (Qwen3.5-MoE's sparse block
        sets its router's weight). The parameters already set are out of their reach meanwhile (on
        the meta device), so only the unset ones change."""
        params = dict(module.named_parameters(recurse=False))
        unset = {local for local, param in params.items() if param.isnan().all()}
        if not unset:
            return
        for local in params.keys() - unset:
            module._parameters[local] = nn.Parameter(params[local].to("meta"), params[local].requires_grad)
        try:
            parts = module_name.split(".")
            for depth in reversed(range(len(parts))):
                if not any(params[local].isnan().all() for local in unset):
                    break
                enclosing = ".".join(parts[:depth])
                torch.manual_seed(self.seed + zlib.crc32(f"{enclosing}>{module_name}".encode()))
                self.reference._init_weights(self.reference.get_submodule(enclosing))
        finally:
            for local in params.keys() - unset:
                module._parameters[local] = params[local]


def load_weights(model: nn.Module, weights: SafetensorsWeights | RandomWeights, device: torch.device) -> None:
    """Fill every (sharded) parameter of `model` with its slice, in the parameter's dtype (float32
    masters; a LoRA run's frozen base in the compute dtype); LoRA adapters, which no model file
    holds, are left to their own initialisation (LoRA.initialise_adapters)."""
    with torch.no_grad(), weights.reading():
        # By name: QLoRA replaces its NF4 parameters as it goes, and a list of the parameters
        # would keep every replaced one alive (the whole NF4 base twice).
        for name in [name for name, param in model.named_parameters() if is_nf4(param)]:
            # QLoRA: the whole weight read (one at a time) and quantised where it is used
            module_name, _, attr = name.rpartition(".")
            full = weights.read(clean_name(name), tuple(slice(None) for _ in _full_shape(model, name)), device)
            model.get_submodule(module_name).register_parameter(attr, quantized(full))
        # no model file holds LoRA adapters: LoRA.initialise_adapters (sft/adapters/lora.py)
        shards = [(clean_name(name), *local_slice(param)) for name, param in model.named_parameters()
                  if not is_nf4(param) and not is_adapter(clean_name(name))]
        # closed before the files are (`reading`), also when a copy fails: no read is left running
        with contextlib.closing(weights.read_many(((name, index) for name, index, _ in shards), device)) as slices:
            for (_, _, local), tensor in zip(shards, slices, strict=True):
                # read on the compute device; copy_ casts to the shard's dtype and moves to offloaded shards' host
                # memory
                local.copy_(tensor)
        for name, buffer in persistent_buffers(model).items():  # whole on every rank
            if weights.holds(name):
                buffer.copy_(weights.read(name, tuple(slice(None) for _ in buffer.shape), device))


def _full_shape(model: nn.Module, name: str) -> torch.Size:
    """Parameter `name`'s shape as the model defines it (a fused expert weight stored in NF4 is 2-D)."""
    module_name, _, attr = name.rpartition(".")
    return full_shape(model.get_submodule(module_name), attr)


def initial_weights(cfg: ModelConfig, seed: int, model: nn.Module) -> SafetensorsWeights | RandomWeights:
    """Collective: where `model`'s initial weights come from. Rank 0 opens and checks the files
    first, so missing or mismatched weights are one error, said once."""
    if cfg.init != "pretrained":
        return RandomWeights(cfg, seed)

    def opened() -> SafetensorsWeights:
        weights = SafetensorsWeights(cfg.name_or_path, model)
        if not dist.is_initialized() or dist.get_rank() == 0:
            weights.check()
        return weights
    return rank0_first(opened)


def write_model_files(cfg: ModelConfig, model: nn.Module, directory: Path) -> None:
    """Rank 0: a checkpoint's model files (hf/): the model's config.json or, for a vision-language
    checkpoint, the original config.json and the tensors of the files the run does not train, as
    the files hold them (vision_language.KEPT), so that the export is the original checkpoint."""
    config = model_config(cfg)
    if not is_vision_language(config):
        model.config.save_pretrained(directory)
        return
    config.save_pretrained(directory)
    weights = SafetensorsWeights(cfg.name_or_path, model)
    copy_processor_files(weights.root, directory)
    with weights.reading():
        kept = {name: weights.read_as_stored(name) for name in weights.kept()}
    save_file(kept, directory / KEPT, metadata={"format": "pt", **weights.names.metadata()})
