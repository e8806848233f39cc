"""LoRA: low-rank adapters on the frozen Linear layers of the decoder blocks (lora.rank > 0), and on
the routed experts of mixture-of-experts blocks (`experts` in lora.target_modules).

A target layer computes  W x + b + (alpha / r) * B A dropout(x)  with A [r, in] and B [out, r]
trained and W, b frozen; A starts Kaiming-uniform and B at zero, as PEFT initialises them, so
training starts from the base model exactly. Everything else is frozen too, but `modules_to_save`
(e.g. the embeddings and lm_head, for new tokens), which train in full.

* Storage: a frozen parameter is kept in the compute dtype (fsdp.param_dtype: no float32 master
  copy), gets no gradient, no optimizer state and no place in the checkpoints (`LoRA.checkpointed`);
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
  for these (target_parameters) is written and read by sft/adapters/peft_format.py.
* FSDP2 shards frozen and trainable parameters of a block in one unit; only the adapters' gradients
  are reduce-scattered. QLoRA's NF4 weights are the exception: every rank holds them whole
  (`nf4_parameters`); on one GPU FSDP leaves the whole frozen base alone (sft/parallel/fsdp.py:
  whole_frozen).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sft.config import LoRAConfig, ModelConfig
from sft.distributed import local_part, local_slice
from sft.errors import UserError
from sft.hub.layout import is_adapter
from sft.models.build import clean_name
from sft.models.experts import EXPERT_WEIGHTS, grouped_linear
from sft.models.moe import general_path_blocks, routed_experts
from sft.models.nf4 import NF4_GROUP, dequantized, is_nf4, quantize_in_place, splits_into_nf4_groups


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
        # (sft/parallel/float8.py, which the planner, importing this module, does not need)
        self.base_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if is_nf4(weight) and torch.compiler.is_compiling():
            # Compiled, the partitioner would keep each dequantised bf16 weight for the backward
            # (2 bytes a base parameter: QLoRA's saving gone); checkpointed, it keeps the NF4 data and
            # dequantises again there. Eager, torchao's NF4 linear already saves only the NF4 weight.
            weight = checkpoint(dequantized, weight, x.dtype, use_reentrant=False)
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
        """The adapters' output for `rows` sorted by (this rank's) expert (`ends[e]`: the end row of
        expert e). Under expert parallelism the adapters are sharded by expert as the weight is."""
        a, b = local_part(self.lora_A), local_part(self.lora_B)
        if pad := grouped_rank(a.shape[1]) - a.shape[1]:  # zeros, which add nothing
            a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
        return grouped_linear(grouped_linear(self.dropout(rows), a, ends), b, ends) * self.scaling


def grouped_rank(rank: int) -> int:
    """The rank an expert adapter's grouped GEMMs run at: a multiple of 8 (16-byte rows of bf16)."""
    return rank + -rank % 8


# lora.target_modules' name for the routed experts of the mixture-of-experts blocks on our path
EXPERTS = "experts"


def initial_adapter(name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """The initial value of adapter parameter `name` (float32): lora_A Kaiming-uniform as PEFT draws
    it (nn.Linear's own init; each expert's as its own Linear), seeded by the name so that it does
    not depend on the number of ranks; lora_B zero."""
    if ".lora_B" in name:
        return torch.zeros(shape, device=device)
    generator = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))
    bound = 1 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)) of nn.Linear: U(-1/sqrt(in), 1/sqrt(in))
    return torch.empty(shape, device=device).uniform_(-bound, bound, generator=generator)




@dataclass
class LoRA:
    """What apply_lora did (None without LoRA), handed to every room that must know: the adapted
    layers (float8 runs their frozen base matmuls), the base weights FSDP leaves whole (QLoRA's NF4),
    what a checkpoint holds (`checkpointed`) and what the log says (`summary`)."""

    cfg: LoRAConfig
    layers: list[LoRALinear]
    experts: list[nn.Module]  # the experts modules whose fused weights have adapters
    targets: list[str]  # the short names of the adapted layers (q_proj, ..., experts), sorted
    summary: str

    @property
    def widths(self) -> frozenset[int]:
        """The adapters' inner widths (the rank; the experts' grouped GEMMs run it padded):
        activation checkpointing tells their matmuls from the base's by them. A base matmul of
        that width (eager attention's scores at a head_dim equal to the rank, a router with as many
        experts) is then recomputed too: correct, a little more work."""
        return frozenset((self.cfg.rank, *([grouped_rank(self.cfg.rank)] if self.experts else [])))

    def initialise_adapters(self, model: nn.Module, seed: int, device: torch.device) -> None:
        """Every adapter of `model` (sharded or not) to its initial value (`initial_adapter`), after
        the base weights were loaded: no model file or prepared-model cache holds them."""
        with torch.no_grad():
            for name, param in model.named_parameters():
                if is_adapter(clean_name(name)):
                    index, local = local_slice(param)
                    local.copy_(initial_adapter(clean_name(name), tuple(param.shape), seed, device)[index])

    def checkpointed(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters a checkpoint holds, by the name the state dict gives them (without the
        activation checkpointing wrapper's prefix): those that train (the frozen base is read again
        from its source)."""
        return {clean_name(name): param for name, param in model.named_parameters() if param.requires_grad}

    # sft/adapters/record.py imported where used: it reads the base's files (sft/hub/), which the planner,
    # importing this module on login nodes for the adapters' shapes, never loads
    def record(self, model_cfg: ModelConfig, seed: int, model: nn.Module, prepared: Path | None) -> dict:
        """What its adapters are trained on, for a checkpoint's train state (sft/adapters/record.py)."""
        from sft.adapters.record import adapters_record

        return adapters_record(model_cfg, self.cfg, self.targets, seed, model, prepared)

    def check_resume(self, path: Path, saved: dict | None, ours: dict) -> None:
        """Refuse to resume checkpoint `path`, whose train state records `saved`, onto other adapters,
        or another base or scale unless lora.allow_resume_change (sft/adapters/record.py)."""
        from sft.adapters.record import lora_change_problem

        lora_change_problem(path, saved, ours, self.cfg.allow_resume_change)

    def nf4_parameters(self) -> set[nn.Parameter]:
        """The NF4 base weights, which FSDP leaves alone: every rank holds each of them whole (a
        quarter of the bfloat16 bytes), as QLoRA with data parallelism does elsewhere (PEFT +
        bitsandbytes), and dequantises it in its own matmuls; FSDP2 cannot gather NF4 shards on one
        rank (torch 2.13)."""
        return {weight for module in [*self.layers, *self.experts] for weight in _adapted_weights(module)
                if is_nf4(weight)}


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
    if EXPERTS in missing and (general := general_path_blocks(blocks)):
        raise LoRAError(f"lora.target_modules={cfg.target_modules}: {general} blocks take the general mixture-of-"
                        "experts path (transformers' own experts), whose experts take no adapters yet; remove experts")
    if missing or not (targets or experts):
        names = sorted(_targets(blocks, ["all-linear"])) + ([EXPERTS] if routed_experts(blocks) else [])
        if not names:  # GPT-2's blocks multiply with Conv1D
            kinds = sorted({type(m).__name__ for block in blocks for m in block.modules()
                            if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2})
            raise LoRAError(f"lora.target_modules={cfg.target_modules}: the decoder blocks have no Linear layer to "
                            f"adapt (their weights are in {', '.join(kinds) or 'no 2-D weight'}); train this "
                            "architecture in full (lora.rank: 0)")
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
    unquantized = _quantize_targets(model, experts) if cfg.base == "nf4" else []
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    in_full = f", training {', '.join(cfg.modules_to_save)} in full" if saved else ""
    if cfg.base == "nf4":
        in_full += "; base weights of the adapted layers in NF4" + (
            f" but {', '.join(unquantized)}, which do not split into NF4 groups of {NF4_GROUP} values"
            if unquantized else "")
    names = sorted([*targets, *([EXPERTS] if experts else [])])
    where = [f"{len(adapted)} layers"] if adapted else []
    where += [f"the routed experts of {len(experts)} blocks"] if experts else []
    return LoRA(cfg, adapted, experts, names,
                f"applied LoRA (rank {cfg.rank}, alpha {cfg.alpha:g}) to {' and '.join(where)} "
                f"({', '.join(names)}){in_full}: {trained / 1e6:.2f}M of "
                f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters train")


def _quantize_targets(model: nn.Module, experts: list[nn.Module]) -> list[str]:
    """QLoRA: the adapted layers' and experts' frozen weights as NF4 tensors (still on the meta
    device: each rank quantises the whole weight as it loads, sft/hub/weights.py); return the
    names of those whose weights do not split into NF4 groups, which stay in the compute dtype."""
    kept = set()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            if splits_into_nf4_groups(module.weight):
                quantize_in_place(module, "weight")
            else:
                kept.add(name.rsplit(".", 1)[-1])
    for module in experts:
        for name in EXPERT_WEIGHTS:
            if splits_into_nf4_groups(getattr(module, name)):
                quantize_in_place(module, name)
            else:
                kept.add(f"{EXPERTS}.{name}")
    return sorted(kept)


def nf4_weights(model: nn.Module) -> list[nn.Parameter]:
    """The base weights QLoRA stores in NF4: those of the adapted layers and experts that split into
    NF4 groups."""
    return [weight for module in model.modules() for weight in _adapted_weights(module)
            if splits_into_nf4_groups(weight)]


def _adapted_weights(module: nn.Module) -> list[nn.Parameter]:
    """The frozen weights of `module` that LoRA adapts: a LoRALinear's, or an experts module's fused ones."""
    if isinstance(module, LoRALinear):
        return [module.weight]
    return [getattr(module, name) for name in EXPERT_WEIGHTS if f"{name}_lora" in module._modules]


def _names(module_name: str, name: str) -> bool:
    """Whether `name` (as lora.modules_to_save gives it) names the module `module_name`."""
    return module_name == name or module_name.endswith(f".{name}")
