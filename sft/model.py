"""Memory-safe model construction: build on meta, (shard elsewhere), materialise shards, fill them.

No rank ever holds a full copy of the weights. The model is built on the meta device in float32
(so the sharded master weights are float32 from the start, and no whole-model cast is needed);
`accelerate.init_empty_weights` keeps buffers such as rotary `inv_freq` real and float32. After
`fully_shard`, `to_empty` gives each rank storage for its own shards only, and every rank reads
just its own slice of each tensor:

* pretrained: straight from the safetensors files (`safe_open(...).get_slice`), so each rank reads
  1/world of the checkpoint and no collective is needed;
* random: each parameter-holding module is initialised in full on the device by the
  architecture's own `_init_weights`, seeded by its name, one module at a time; the rank keeps its
  slice. The values are independent of the number of ranks.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from sft import moe
from sft.config import ModelConfig, is_local_path
from sft.errors import UserError
from sft.distributed import rank0_first

# What activation checkpointing inserts into parameter names (blocks are compiled in place,
# which adds nothing).
_AC_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


class ModelError(UserError):
    """The model or tokenizer cannot be used as configured; the message names the fix."""


def clean_name(name: str) -> str:
    """Parameter/buffer name as in the Hugging Face checkpoint (wrapper prefixes removed)."""
    return name.replace(_AC_WRAPPER_PREFIX, "")


def _missing_local_dir(key: str, path: str) -> ModelError | None:
    """A clear error for a path that names a local directory that is not there (a hub id is
    'org/name'; anything else with a slash, or starting with . / ~, is a path)."""
    if is_local_path(path) and not Path(path).expanduser().is_dir():
        return ModelError(f"{key}={path!r}: no such directory; give an existing model directory or a hub id "
                          "(e.g. Qwen/Qwen2.5-7B-Instruct)")
    return None


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    key, source = ("model.tokenizer", cfg.tokenizer) if cfg.tokenizer else ("model.name_or_path", cfg.name_or_path)
    missing = _missing_local_dir(key, source)
    if missing:
        raise missing
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        raise ModelError(f"{key}={source!r}: could not load a tokenizer: {e}") from None
    if not tokenizer.chat_template:
        raise ModelError(f"{key}={source!r} has no chat template; use an instruct model's "
                         "tokenizer or add chat_template to its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        # Pads are never attended to by real tokens nor trained, so any id will do.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_meta_model(cfg: ModelConfig) -> PreTrainedModel:
    """The model with parameters on the meta device (float32) and real float32 buffers."""
    missing = _missing_local_dir("model.name_or_path", cfg.name_or_path)
    if missing:
        raise missing
    try:
        config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"model.name_or_path={cfg.name_or_path!r}: could not load config.json ({reason}); give a "
                         "local model directory, or a hub name this machine can reach") from None
    config.use_cache = False  # no KV cache while training (and packing relies on it being off)
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     attn_implementation=cfg.attn_implementation,
                                                     trust_remote_code=cfg.trust_remote_code)
    except (ValueError, ImportError) as e:  # transformers refuses the config, or the attention kernel here
        reason = " ".join(str(e).split())
        if "ttention" in reason:
            raise ModelError(f"model.attn_implementation={cfg.attn_implementation!r}: {reason}; use sdpa (or "
                             "flex_attention for packed rows)") from None
        raise ModelError(f"model.name_or_path={cfg.name_or_path!r}: transformers cannot build a model from its "
                         f"config.json ({reason})") from None
    model.tie_weights()  # from_config under init_empty_weights leaves tied embeddings as two tensors
    return model


def decoder_blocks(model: PreTrainedModel) -> list[nn.Module]:
    """The repeated decoder blocks, found from the model's own `_no_split_modules` (no per-arch code)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    # Through the MRO, so blocks are still found once FSDP has swapped in its FSDP<Block> subclass.
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not blocks:
        raise ModelError(f"{type(model).__name__}: cannot find its decoder blocks "
                         f"(_no_split_modules={sorted(names)}); this architecture is not supported")
    return blocks


def real_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the (real, non-meta) buffers, to restore after `to_empty` overwrote them."""
    return {clean_name(n): b.detach().clone() for n, b in model.named_buffers()}


class SafetensorsWeights:
    """Reads slices of named tensors from a Hugging Face safetensors checkpoint directory."""

    def __init__(self, directory: str, model: nn.Module):
        root = Path(directory)
        if not root.is_dir():  # a hub id: the files are fetched once into the HF cache
            root = Path(snapshot_download(directory, allow_patterns=["*.safetensors", "*.json"]))
        self.source, self.root = directory, root
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
        # MoE: fused expert parameters are per-expert tensors in the hub files (sft/moe.py)
        self.model_type = model.config.model_type
        self.shapes = {clean_name(n): tuple(p.shape) for n, p in model.named_parameters()}

    def _damaged(self, file: str, reason: str) -> ModelError:
        return ModelError(f"model.name_or_path={self.source!r}: {self.root / file} is damaged ({reason}); download "
                          "it again (huggingface-cli download), or give a complete model directory")

    @contextlib.contextmanager
    def _open(self, file: str, device: str = "cpu") -> Iterator:
        """safe_open of one of the checkpoint's files; a file that is not safetensors (truncated,
        empty, overwritten) is one ModelError naming it."""
        try:
            handle = safe_open(self.root / file, framework="pt", device=device)
        except (SafetensorError, OSError) as e:
            raise self._damaged(file, " ".join(str(e).split())) from None
        with handle as f:
            yield f

    def check(self) -> None:
        """One clear error if the files lack a parameter of the model or hold it in another shape
        (weights of another architecture or size than their config.json), before any rank reads."""
        shapes = {}
        for file in sorted(set(self.weight_map.values())):  # headers only
            with self._open(file) as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        quantized = moe.quantized_experts_problem(self.source, shapes)
        if quantized:
            raise ModelError(quantized)
        expected = {}
        for name, shape in self.shapes.items():
            expected.update({name: shape} if name in shapes else moe.hub_shapes(self.model_type, name, shape))
        wrong = [f"{name}: {shape} in the model of config.json, {shapes.get(name, 'absent')} in the files"
                 for name, shape in expected.items() if shapes.get(name) != shape]
        if wrong:
            raise ModelError(f"model.name_or_path={self.source!r}: its weights do not match its config.json "
                             f"({len(wrong)} tensors differ, "
                             f"e.g. {wrong[0]}); give a directory whose safetensors and config.json belong together")

    def read(self, name: str, index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        if name not in self.weight_map and moe.is_fused_expert(name):
            return moe.read_fused_slice(lambda hub, i: self.read(hub, i, device), self.model_type, name,
                                        self.shapes[name], index)
        name = name if name in self.weight_map else moe.hub_name(self.model_type, name)
        # Opened per tensor: the file is memory-mapped, and closing it unmaps the pages this rank
        # touched, so host memory holds at most one slice beyond the rank's own shards.
        with self._open(self.weight_map[name]) as f:
            return f.get_slice(name)[index].to(device)


class RandomWeights:
    """The architecture's own random init, one module at a time, seeded by module name."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.reference = build_meta_model(cfg)
        self.seed = seed
        self._module_name: str | None = None

    def read(self, name: str, index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        module_name, _, param_name = name.rpartition(".")
        module = self.reference.get_submodule(module_name)
        if module_name != self._module_name:
            if self._module_name is not None:  # free the previous module's full tensors
                self.reference.get_submodule(self._module_name).to_empty(device="meta", recurse=False)
            module.to_empty(device=device, recurse=False)
            torch.manual_seed(self.seed + zlib.crc32(module_name.encode()))
            self.reference._init_weights(module)
            self._module_name = module_name
        return getattr(module, param_name).detach()[index]


def load_weights(model: nn.Module, weights: SafetensorsWeights | RandomWeights, device: torch.device) -> None:
    """Fill every (sharded) parameter of `model` with its slice; float32 master copies."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                # The public chunk description DCP itself uses: where this rank's shard sits.
                chunk = param.__create_chunk_list__()[0]
                shape, offset, local = chunk.sizes, chunk.offsets, param.to_local()
            else:
                shape, offset, local = param.shape, (0,) * param.dim(), param
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            # read on the compute device; copy_ casts to float32 and moves to offloaded shards' host memory
            local.copy_(weights.read(clean_name(name), index, device))


def materialize(model: nn.Module, buffers: dict[str, torch.Tensor], device: torch.device,
                offload: bool = False) -> None:
    """Allocate storage for this rank's shards on `device` (values undefined until load_weights or
    a checkpoint fills them) and restore the buffers."""
    # With CPU offload, FSDP keeps the shards in host memory.
    model.to_empty(device="cpu" if offload else device)
    # to_empty gives every parameter new storage, which unties tied embeddings on an unsharded
    # model (FSDP2 keeps one shared parameter); re-tie before loading so one tensor is filled.
    model.tie_weights()
    for module_name, module in model.named_modules():
        for name in list(module._buffers):
            if module._buffers[name] is not None:  # buffers are not sharded; they live on the device
                module._buffers[name] = buffers[clean_name(f"{module_name}.{name}".lstrip("."))].to(device)
    assert not any(p.is_meta for p in model.parameters()), "a parameter is still on the meta device"


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
