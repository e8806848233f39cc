"""Filling this rank's shards: each rank reads only its own slice of each tensor, so no rank ever
holds a full copy of the weights.

* pretrained: straight from the safetensors files (`safe_open(...).get_slice`), so each rank reads
  1/world of the checkpoint and no collective is needed; tensors the files hold otherwise than the
  model (one per expert, renamed, q/k/v apart) converted as transformers converts them (sft/hub/layout.py);
* random: each parameter-holding module is initialised in full on the device by the
  architecture's own `_init_weights`, seeded by its name, one module at a time; the rank keeps its
  slice. The values are independent of the number of ranks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import snapshot_download
from transformers import AutoConfig, AutoModelForImageTextToText
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from sft.config import ModelConfig
from sft.distributed import local_slice, rank0_first
from sft.hub.layout import FileLayout, is_adapter, quantized_experts_problem
from sft.hub.vision_language import KEPT, checkpoint_class, file_names, kept_names
from sft.models.architecture import decoder
from sft.models.build import (ModelError, build_meta_model, clean_name, missing_local_dir, model_config,
                              persistent_buffers, real_buffers)
from sft.models.nf4 import full_shape, is_nf4, quantized
from sft.models.vision_language import is_vision_language


# Within SafetensorsWeights.reading, a file is closed (and opened again when next read) after an eighth of
# it, at most REOPEN_AFTER_BYTES, was read from it: the file is memory-mapped, and closing it unmaps the
# pages this rank touched, so host memory holds at most that much of the files beyond the rank's own
# shards; each open parses the file's header again (a reopen every 64 MiB made a 22 GB load 1.5x slower).
REOPEN_AFTER_BYTES = 512 * 2**20


class SafetensorsWeights:
    """Reads slices of named tensors from a Hugging Face safetensors checkpoint directory."""

    def __init__(self, directory: str, model: nn.Module):
        if missing := missing_local_dir("model.name_or_path", directory):
            raise missing
        root = Path(directory)
        if not root.is_dir():  # a hub id: the files are fetched once into the HF cache
            root = Path(snapshot_download(directory, allow_patterns=["*.safetensors", "*.json"]))
        self.source, self.root = directory, root
        self._open_files: dict | None = None  # the files `reading` keeps open, by name
        index = root / "model.safetensors.index.json"
        if index.is_file():
            try:
                self.weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise self._damaged(index.name, f"{type(e).__name__}: {e}") from None
        elif (root / "model.safetensors").is_file():
            with self._open("model.safetensors") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ModelError(f"model.name_or_path={directory!r}: no model.safetensors(.index.json) there; "
                             "download the weights (huggingface-cli download) or set model.init: random")
        self.model = model
        self.shapes = {clean_name(n): tuple(_full_shape(model, n)) for n, _ in model.named_parameters()
                       if not is_adapter(n)}
        # The language model of a vision-language checkpoint sits under a prefix of the files' own
        # (sft/models/vision_language.py); the identity for a text model.
        self.file_shapes = self._file_shapes_by_name()  # the files' headers, read once
        self.names = file_names(self.file_shapes, decoder(model)[0], tuple(model.get_input_embeddings().weight.shape))

    @functools.cached_property
    def layout(self) -> FileLayout:
        """The files' tensors by the model's names, as transformers converts them (renamed, experts
        fused, q/k/v concatenated...: sft/hub/layout.py); not needed for a digest."""
        in_model = {self.names.in_model(name): shape for name, shape in self.file_shapes.items()}
        in_model.pop(None, None)
        buffers = {name: tuple(b.shape) for name, b in persistent_buffers(self.model).items()}
        return FileLayout(self.model, {**self.shapes, **buffers}, in_model, checkpoint_class(self.root))

    def _damaged(self, file: str, reason: str) -> ModelError:
        return ModelError(f"model.name_or_path={self.source!r}: {self.root / file} is damaged ({reason}); download "
                          "it again (huggingface-cli download), or give a complete model directory")

    @contextlib.contextmanager
    def _open(self, file: str) -> Iterator:
        """One of the checkpoint's files, open (within `reading`, kept open); a file that is not
        safetensors (truncated, empty, overwritten) is one ModelError naming it."""
        if self._open_files is None:
            with self._safe_open(file) as f:
                yield f
            return
        if file not in self._open_files:
            budget = min(REOPEN_AFTER_BYTES, (self.root / file).stat().st_size // 8)
            self._open_files[file] = [self._safe_open(file).__enter__(), budget]
        yield self._open_files[file][0]

    def _safe_open(self, file: str):
        try:
            return safe_open(self.root / file, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise self._damaged(file, " ".join(str(e).split())) from None

    def _have_read(self, file: str, nbytes: int) -> None:
        """Within `reading`: `nbytes` more read from `file`; past its budget it is closed."""
        if self._open_files is not None and file in self._open_files:
            self._open_files[file][1] -= nbytes
            if self._open_files[file][1] <= 0:
                self._open_files.pop(file)[0].__exit__(None, None, None)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Within it, a file stays open (its header, which lists every tensor of the file, parsed once:
        a checkpoint of per-expert tensors has tens of thousands) until an eighth of it (at most
        REOPEN_AFTER_BYTES) was read from it, and at the end."""
        self._open_files = {}
        try:
            yield
        finally:
            files, self._open_files = self._open_files, None
            for handle, _ in files.values():
                handle.__exit__(None, None, None)

    def _file_shapes_by_name(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape in the files, by name (their headers only)."""
        shapes = {}
        for file in sorted(set(self.weight_map.values())):
            with self._open(file) as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        return shapes

    def kept(self) -> list[str]:
        """The files' tensors the model does not hold (a vision-language checkpoint's vision tower)."""
        trained = {self.names.of(source) for name in self.layout.groups for source in self.layout.sources(name)}
        return kept_names(self.weight_map, trained)

    def holds(self, name: str) -> bool:
        """Whether the files hold the model's tensor `name` (a buffer may be absent: its init stands)."""
        return name in self.layout.groups

    def read_as_stored(self, name: str) -> torch.Tensor:
        """Tensor `name` of the files, whole, in its stored dtype."""
        with self._open(self.weight_map[name]) as f:
            tensor = f.get_tensor(name)
        self._have_read(self.weight_map[name], tensor.nbytes)
        return tensor

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
        language_model = {id(p) for module in (whole.get_decoder(), whole.get_output_embeddings())
                          for p in module.parameters()}
        shapes = {name: tuple(p.shape) for name, p in whole.named_parameters() if id(p) not in language_model}
        layout = functools.cache(lambda: FileLayout(whole, shapes, self.file_shapes).shapes)
        return shapes, layout

    def read(self, name: str, index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        """Slice `index` of the model's tensor `name` (absent: a KeyError naming it; check() said so first)."""
        return self.layout.read(self._read_file, name, index).to(device)

    def _read_file(self, model_name: str, index) -> torch.Tensor:
        """Slice `index` of the files' tensor that the model would call `model_name`."""
        file_name = self.names.of(model_name)
        with self._open(self.weight_map[file_name]) as f:
            tensor = f.get_slice(file_name)[index]
        self._have_read(self.weight_map[file_name], tensor.nbytes)
        return tensor


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
        for name in [name for name, _ in model.named_parameters()]:
            param = model.get_parameter(name)
            if is_nf4(param):  # QLoRA: the whole weight read (one at a time) and quantised where it is used
                module_name, _, attr = name.rpartition(".")
                full = weights.read(clean_name(name), tuple(slice(None) for _ in _full_shape(model, name)), device)
                model.get_submodule(module_name).register_parameter(attr, quantized(full))
                continue
            if is_adapter(clean_name(name)):
                continue  # no model file holds them: LoRA.initialise_adapters (sft/adapters/lora.py)
            index, local = local_slice(param)
            # read on the compute device; copy_ casts to the shard's dtype and moves to offloaded shards' host memory
            local.copy_(weights.read(clean_name(name), index, device))
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
    with weights.reading():
        kept = {name: weights.read_as_stored(name) for name in weights.kept()}
    save_file(kept, directory / KEPT, metadata={"format": "pt", **weights.names.metadata()})
