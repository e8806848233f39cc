"""QLoRA's frozen base in 4-bit NormalFloat (lora.base: nf4): torchao's NF4Tensor, what it costs,
how a weight is stored and read back. torchao's NF4 tensors are 2-D: a fused expert weight
[E, out, in] (or [E, in, out]) is stored as its [E x out, in] rows, its full shape kept on its
module (`full_shapes`), and viewed back where it is used (sft/models/experts.py)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

# Bytes per frozen parameter of an NF4 weight: 4 bits a value, an int8 scale per block of 64
# values, a float32 scale of those per 256 blocks.
NF4_BYTES_PER_PARAMETER = 0.5 + 1 / 64 + 4 / (64 * 256)

# Bytes a value at the peak of an eager dequantisation to bf16 (torchao's get_original_weight: the
# bf16 result and int64 index tensors at once; measured on the CPU at 8.5 above the peak before it,
# which the NF4 source's own bf16 had set). Compiled, the dequantisation fuses: the bf16 result alone.
NF4_EAGER_DEQUANT_BYTES = 10

# torchao's NF4Tensor quantises a weight in blocks of 64 values and their scales in groups of 256
# blocks: a weight must hold a multiple of this many values.
NF4_GROUP = 64 * 256


def is_nf4(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def splits_into_nf4_groups(weight: torch.Tensor) -> bool:
    return weight.numel() % NF4_GROUP == 0


def quantized(full: torch.Tensor) -> nn.Parameter:
    """Frozen base weight `full` (2-D, or a fused expert weight's 3-D) as an NF4 parameter of its
    rows, on `full`'s device (on the meta device too: each rank quantises the real weight as it loads)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    # compile's cache would like a hash of each NF4 weight; without one it only compiles again
    warnings.filterwarnings("ignore", message="NF4Tensor does not implement _stable_hash_for_caching")
    return nn.Parameter(to_nf4(full.detach().to(torch.bfloat16).reshape(-1, full.shape[-1])), requires_grad=False)


def quantize_in_place(module: nn.Module, name: str) -> None:
    """Module `module`'s frozen parameter `name` as NF4, its full shape kept where it is not 2-D."""
    weight = getattr(module, name)
    if weight.dim() != 2:
        module.full_shapes = {**getattr(module, "full_shapes", {}), name: weight.shape}
    setattr(module, name, quantized(weight))


def full_shape(module: nn.Module, name: str) -> torch.Size:
    """The shape of `module`'s parameter `name` as the model defines it (before NF4 storage)."""
    return getattr(module, "full_shapes", {}).get(name) or getattr(module, name).shape


def dequantized(weight: torch.Tensor, dtype: torch.dtype, shape: torch.Size | None = None) -> torch.Tensor:
    """An NF4 weight in `dtype`, in `shape` (its full shape) where given."""
    full = weight.to(dtype)
    return full.view(shape) if shape is not None else full
