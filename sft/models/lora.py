"""LoRA: low-rank adapters on the frozen Linear layers of the decoder blocks (lora.rank > 0), and on
the routed experts of mixture-of-experts blocks (`experts` in lora.target_modules).

A target layer computes  W x + b + (alpha / r) * B A dropout(x)  with A [r, in] and B [out, r]
trained and W, b frozen; A starts Kaiming-uniform and B at zero, as PEFT initialises them, so
training starts from the base model exactly. Everything else is frozen too, but `modules_to_save`
(e.g. the embeddings and lm_head, for new tokens), which train in full.

* Storage: a frozen parameter is kept in the compute dtype (fsdp.param_dtype: no float32 master
  copy), gets no gradient, no optimizer state and no place in the checkpoints (`checkpointed_parameters`);
  the base is read again from the model's files when a run resumes. The adapters and the modules
  to save keep float32 masters and AdamW moments, like full fine-tuning.
* Names: a `LoRALinear` takes the Linear's place and keeps its `weight` and `bias` under their own
  names (they load from the Hugging Face files as they are); the adapter is `lora_A` and `lora_B`,
  as in PEFT's files (sft/export.py writes PEFT's adapter format, or merges the adapter in).
* Routed experts: each fused expert weight (experts.gate_up_proj, experts.down_proj: [E, out, in],
  or [E, in, out] where the model stores them transposed) gets one adapter per expert, an
  `ExpertLoRA` beside it (`experts.gate_up_proj_lora.lora_A` [E, r, in], `.lora_B` [E, out, r]),
  run on the rows sorted by expert through grouped GEMMs as the weight is (sft/models/experts.py):
  the low-rank path costs 2 r (in + out) a row, and no merged weight is ever formed. PEFT's format
  for these (target_parameters) is written and read by sft/models/peft_format.py.
* FSDP2 shards frozen and trainable parameters of a block in one unit; only the adapters' gradients
  are reduce-scattered. QLoRA's NF4 weights are the exception: every rank holds them whole
  (`nf4_parameters`).
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sft.config import LoRAConfig
from sft.errors import UserError
from sft.models.build import clean_name
from sft.models.experts import EXPERT_WEIGHTS, grouped_linear
from sft.models.moe import routed_experts


class LoRAError(UserError):
    """A LoRA setting that does not fit the model; the message names the key and the fix."""

    shared = True  # every rank applies the same config to the same model


class LoRALinear(nn.Module):
    """A frozen Linear with a low-rank adapter beside it."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        factory = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **factory)
        self.scaling = scaling
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        # x -> x W^T for the frozen base, when not F.linear's: precision.float8 sets its float8 matmul
        # (sft/models/float8.py, which the planner, importing this module, does not need)
        self.base_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if is_nf4(weight) and torch.compiler.is_compiling():
            # Compiled, the partitioner would keep each dequantised bf16 weight for the backward
            # (2 bytes a base parameter: QLoRA's saving gone); checkpointed, it keeps the NF4 data and
            # dequantises again there. Eager, torchao's NF4 linear already saves only the NF4 weight.
            weight = checkpoint(_dequantized, weight, x.dtype, use_reentrant=False)
        if self.base_matmul is not None:
            base = self.base_matmul(x, weight)
            base = base + self.bias if self.bias is not None else base
        else:
            base = F.linear(x, weight, self.bias)
        return base + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


class ExpertLoRA(nn.Module):
    """Low-rank adapters of one fused expert weight, one per expert: expert e adds
    (alpha / r) B[e] A[e] dropout(x) to each of its rows, A [E, r, in] and B [E, out, r] float32,
    initialised as LoRALinear's (`initial_adapter`)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, rank: int, scaling: float,
                 dropout: float, device: torch.device):
        super().__init__()
        factory = {"device": device, "dtype": torch.float32}
        self.lora_A = nn.Parameter(torch.empty(num_experts, rank, in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(num_experts, out_features, rank, **factory))
        self.scaling = scaling
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The adapters' output for `rows` sorted by expert (`ends[e]`: the end row of expert e)."""
        down = grouped_linear(self.dropout(rows), self.lora_A, ends)
        return grouped_linear(down, self.lora_B, ends) * self.scaling


# lora.target_modules' name for the routed experts of the mixture-of-experts blocks on our path
EXPERTS = "experts"


# Bytes per frozen parameter of a 4-bit NormalFloat base (lora.base: nf4, torchao's NF4Tensor): 4 bits
# a value, an int8 scale per block of 64 values, a float32 scale of those per 256 blocks.
NF4_BYTES_PER_PARAMETER = 0.5 + 1 / 64 + 4 / (64 * 256)


def initial_adapter(name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """The initial value of adapter parameter `name` (float32): lora_A Kaiming-uniform as PEFT draws
    it (nn.Linear's own init; each expert's as its own Linear), seeded by the name so that it does
    not depend on the number of ranks; lora_B zero."""
    if ".lora_B" in name:
        return torch.zeros(shape, device=device)
    generator = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))
    bound = 1 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)) of nn.Linear: U(-1/sqrt(in), 1/sqrt(in))
    return torch.empty(shape, device=device).uniform_(-bound, bound, generator=generator)


def checkpointed_parameters(model: nn.Module, lora: LoRA | None) -> dict[str, nn.Parameter]:
    """The parameters a checkpoint holds, by the name the state dict gives them (without the
    activation checkpointing wrapper's prefix): all of them, or with LoRA those that train (the
    frozen base is read again from its source)."""
    return {clean_name(name): param for name, param in model.named_parameters() if param.requires_grad or not lora}


@dataclass
class LoRA:
    """What apply_lora did (None without LoRA), handed to every room that must know: the adapted
    layers (float8 runs their frozen base matmuls), the base weights FSDP leaves whole (QLoRA's NF4),
    what a checkpoint holds (`checkpointed_parameters`) and what the log says (`summary`)."""

    cfg: LoRAConfig
    layers: list[LoRALinear]
    targets: list[str]  # the short names of the adapted layers (q_proj, ..., experts), sorted
    summary: str

    def nf4_parameters(self) -> set[nn.Parameter]:
        """The NF4 base weights, which FSDP leaves alone: every rank holds each of them whole (a
        quarter of the bfloat16 bytes), as QLoRA with data parallelism does elsewhere (PEFT +
        bitsandbytes), and dequantises it in its own matmuls; FSDP2 cannot gather NF4 shards on one
        rank (torch 2.13)."""
        return {layer.weight for layer in self.layers if is_nf4(layer.weight)}


def _targets(blocks: list[nn.Module], patterns: list[str]) -> dict[str, list[tuple[nn.Module, str, nn.Linear]]]:
    """short name -> (parent, attribute, Linear) of every Linear of the blocks that `patterns` picks."""
    found: dict[str, list] = {}
    for block in blocks:
        for parent in block.modules():
            for attr, child in parent.named_children():
                if type(child) is nn.Linear and ("all-linear" in patterns or attr in patterns):
                    found.setdefault(attr, []).append((parent, attr, child))
    return found


def apply_lora(model: nn.Module, blocks: list[nn.Module], cfg: LoRAConfig, frozen_dtype: torch.dtype) -> LoRA | None:
    """On the meta-device model: freeze everything, put a LoRALinear in the place of each target
    Linear of `blocks` and an ExpertLoRA beside each fused expert weight (target `experts`), unfreeze
    `modules_to_save`, store frozen parameters in `frozen_dtype` (and the
    target layers' weights in 4-bit NF4 with lora.base: nf4); return the handle. Nothing changes
    when lora.rank is 0 (None)."""
    if not cfg.enabled:
        return None
    linear = [name for name in cfg.target_modules if name != EXPERTS]
    targets = _targets(blocks, linear) if linear else {}
    experts = routed_experts(blocks) if EXPERTS in cfg.target_modules else []
    missing = [name for name in linear if name != "all-linear" and name not in targets]
    missing += [EXPERTS] if EXPERTS in cfg.target_modules and not experts else []
    if missing or not (targets or experts):
        names = sorted(_targets(blocks, ["all-linear"])) + ([EXPERTS] if routed_experts(blocks) else [])
        raise LoRAError(f"lora.target_modules={cfg.target_modules}: {', '.join(missing) or 'nothing'} names no Linear "
                        f"layer{' or routed experts' if EXPERTS in missing else ''} of the decoder blocks; they have "
                        f"{', '.join(names)} (or all-linear)")
    saved = [name for name, _ in model.named_modules() if any(_names(name, save) for save in cfg.modules_to_save)]
    unknown = [save for save in cfg.modules_to_save if not any(_names(name, save) for name in saved)]
    if unknown:
        raise LoRAError(f"lora.modules_to_save={cfg.modules_to_save}: {', '.join(unknown)} names no module of "
                        f"{type(model).__name__}; give the last part of a module's name, e.g. embed_tokens or lm_head")
    model.requires_grad_(False)
    adapted = []
    for layers in targets.values():
        for parent, attr, linear in layers:
            adapted.append(LoRALinear(linear, cfg.rank, cfg.scaling, cfg.dropout))
            setattr(parent, attr, adapted[-1])
    for module in experts:
        for name in EXPERT_WEIGHTS:
            weight = getattr(module, name)  # [E, out, in], or [E, in, out] transposed
            num_experts, rows, columns = weight.shape
            in_features, out_features = (rows, columns) if module.is_transposed else (columns, rows)
            module.add_module(f"{name}_lora", ExpertLoRA(num_experts, in_features, out_features, cfg.rank,
                                                         cfg.scaling, cfg.dropout, weight.device))
    for name in saved:
        model.get_submodule(name).requires_grad_(True)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.requires_grad and param.dtype != frozen_dtype:
                    module.register_parameter(name, nn.Parameter(param.to(frozen_dtype), requires_grad=False))
    model.tie_weights()  # a tied lm_head is the embedding: one parameter, however it was stored
    unquantized = _quantize_targets(model) if cfg.base == "nf4" else []
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    in_full = f", training {', '.join(cfg.modules_to_save)} in full" if saved else ""
    if cfg.base == "nf4":
        in_full += "; base weights of the adapted layers in NF4" + (
            f" but {', '.join(unquantized)}, which do not split into NF4 groups of {NF4_GROUP} values"
            if unquantized else "") + ("; the routed experts' weights stay bfloat16" if experts else "")
    names = sorted([*targets, *([EXPERTS] if experts else [])])
    on_experts = f" and the routed experts of {len(experts)} blocks" if experts else ""
    return LoRA(cfg, adapted, names,
                f"applied LoRA (rank {cfg.rank}, alpha {cfg.alpha:g}) to {len(adapted)} layers{on_experts} "
                f"({', '.join(names)}){in_full}: {trained / 1e6:.2f}M of "
                f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters train")


# torchao's NF4Tensor quantises a weight in blocks of 64 values and their scales in groups of 256
# blocks: a weight must hold a multiple of this many values.
NF4_GROUP = 64 * 256


def _quantize_targets(model: nn.Module) -> list[str]:
    """QLoRA: the target layers' frozen weights as NF4 tensors (still on the meta device: each rank
    quantises the whole weight as it loads, `quantized`); return the layers whose weights do not
    split into NF4 groups, which stay in the compute dtype."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    # compile's cache would like a hash of each NF4 weight; without one it only compiles again
    warnings.filterwarnings("ignore", message="NF4Tensor does not implement _stable_hash_for_caching")
    kept = set()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            if _splits_into_nf4_groups(module):
                module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
            else:
                kept.add(name.rsplit(".", 1)[-1])
    return sorted(kept)


def _splits_into_nf4_groups(module: LoRALinear) -> bool:
    return module.weight.numel() % NF4_GROUP == 0


def nf4_weights(model: nn.Module) -> list[nn.Parameter]:
    """The base weights QLoRA stores in NF4: those of the adapted layers that split into NF4 groups."""
    return [module.weight for module in model.modules()
            if isinstance(module, LoRALinear) and _splits_into_nf4_groups(module)]


def _dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype)


def is_nf4(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def quantized(full: torch.Tensor) -> nn.Parameter:
    """Frozen base weight `full` as an NF4 parameter, on `full`'s device."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return nn.Parameter(to_nf4(full.to(torch.bfloat16)), requires_grad=False)


def _names(module_name: str, name: str) -> bool:
    """Whether `name` (as lora.modules_to_save gives it) names the module `module_name`."""
    return module_name == name or module_name.endswith(f".{name}")
