"""Float8 matmuls for the decoder blocks' Linear layers (torchao), with float32 master weights.

`convert_to_float8_training` swaps `nn.Linear` for torchao's `Float8Linear`: same parameters
(names, shapes, float32 master values), but each matmul casts its inputs to float8 with dynamic
scales and runs on Hopper's float8 tensor cores (2x the bf16 rate). Only the repeated blocks
are converted: the lm_head and embeddings stay in bf16 (the lm_head's 152k-wide output is where
float8 rounding hurts the loss most; the embedding is a lookup, not a matmul).

Recipes (precision.float8):
* tensorwise: one scale per tensor. FSDP all-gathers the weights already cast to float8 (half
  the bytes of bf16), with their scales computed for all blocks in one all-reduce after each
  optimizer step (`precompute_float8_scales`), and each shard's cast compiled into one kernel
  (`fuse_weight_casts`). The fastest.
* rowwise: one scale per row; more accurate with outliers, slower, bf16 all-gather.

With LoRA the blocks' base weights are frozen: torchao's Float8Linear would still compute their
weight gradients (a third of the matmuls). There the adapted layers' base matmuls run through
`frozen_float8_linear` instead (the recipe picks the scales as above; the base weights stay bf16 and
all-gather in bf16), and the adapters stay in bf16.

torchao is an optional dependency (pip install -e '.[fp8]'): only this module uses it, and only
inside the functions, so importing sft.float8 (and training with precision.float8: none) never
needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING

import torch
from torch import nn

from sft.distributed import log0

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

    from sft.adapters.lora import LoRA

# float8 GEMMs (torch._scaled_mm) need both dimensions of the weight to be multiples of 16.
_ALIGNMENT = 16


def float8_linear_config(recipe: str, emulate: bool = False) -> Float8LinearConfig:
    """torchao's config for `recipe`. Tensorwise gets float8 all-gather of the FSDP shards, which
    needs its scales refreshed after every optimizer step (see precompute_float8_scales).
    `emulate`: the same float8 casts, but high-precision matmuls (see apply_float8)."""
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate)
    if recipe == "rowwise":
        return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    raise AssertionError(f"unknown float8 recipe {recipe!r} (the config should have refused it)")


def _skip_reason(linear: nn.Module) -> str | None:
    if linear.in_features % _ALIGNMENT or linear.out_features % _ALIGNMENT:
        return f"in/out features {linear.in_features}/{linear.out_features} not multiples of {_ALIGNMENT}"
    return None


def apply_float8(blocks: list[nn.Module], recipe: str, emulate: bool = False, compiled: bool = False,
                 lora: LoRA | None = None) -> None:
    """Swap the blocks' nn.Linear layers for Float8Linear in place (on the meta model, before
    activation checkpointing, compile and fully_shard wrap them); Linears whose dimensions do not
    suit float8 GEMMs stay as they are. Parameter names and shapes are unchanged. `compiled`: the
    blocks are compiled, and so is the tensorwise all-gather's cast (fuse_weight_casts). With
    `lora` (the LoRA handle), the adapted layers' frozen base matmuls run in float8 instead
    (frozen_float8_linear); frozen Linears without an adapter, and the adapters, stay bf16.

    `emulate` is for CPU tests of the wiring (training refuses float8 on CPU, check_machine):
    CPU's float8 matmul is a reference kernel about 200x slower than torchao's emulation."""
    skipped: dict[str, list[str]] = {}  # reason -> names of the Linears left in high precision

    def convert(linear: nn.Module, name: str) -> bool:
        reason = _skip_reason(linear)
        if reason:
            skipped.setdefault(reason, []).append(name)
        return reason is None

    if lora:
        converted, adapted = 0, set(lora.layers)
        for block in blocks:
            for name, module in block.named_modules():
                if module in adapted:
                    if convert(module, name):
                        module.base_matmul = functools.partial(frozen_float8_linear, recipe=recipe)
                        converted += 1
                elif type(module) is nn.Linear and not name.endswith((".lora_A", ".lora_B")):
                    skipped.setdefault("no adapter", []).append(name)
        what = "the frozen base matmuls of "
    else:
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        config = float8_linear_config(recipe, emulate)
        for block in blocks:  # torchao calls `convert` for every nn.Linear
            convert_to_float8_training(block, module_filter_fn=convert, config=config)
        if recipe == "tensorwise" and compiled:
            fuse_weight_casts()
        what = ""
        converted = sum(isinstance(m, Float8Linear) for block in blocks for m in block.modules())
    details = "; ".join(f"{len(names)} with {reason} (e.g. {names[0]})" for reason, names in skipped.items())
    log0(f"applied float8 ({recipe}) to {what}{converted} linears in {len(blocks)} blocks, "
         f"skipped {sum(map(len, skipped.values()))}" + (f": {details}" if details else ""))


def _to_float8(tensor: torch.Tensor, dtype: torch.dtype, rowwise: bool, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` in float8 and the scale that undoes the cast (float32): one scale for the whole
    tensor, or with `rowwise` one for each slice along `dim` (the matmul's reduction dimension). The
    scale is a power of two, so scaling adds no rounding of its own (torchao's rowwise recipe too)."""
    amax = tensor.abs().amax(dim=dim, keepdim=True) if rowwise else tensor.abs().amax()
    scale = torch.exp2(torch.floor(torch.log2(torch.finfo(dtype).max / amax.float().clamp(min=1e-12))))
    return scale_to_float8(tensor, scale, dtype), scale.reciprocal()


class _FrozenFloat8Matmul(torch.autograd.Function):
    """x W^T for a frozen W in float8: the forward and the input's gradient, and no weight gradient
    (the matmul a LoRA base does not need). It keeps only W for its backward, the parameter FSDP
    gathers again there, and casts it anew: a saved float8 copy would hold every block's weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, rowwise: bool) -> torch.Tensor:
        ctx.rowwise = rowwise
        rows = x.reshape(-1, x.shape[-1])
        x8, x_scale = _to_float8(rows, torch.float8_e4m3fn, rowwise, dim=-1)
        w8, w_scale = _to_float8(weight, torch.float8_e4m3fn, rowwise, dim=-1)
        # One scale for W serves the backward too (a scalar: spares it a pass over W); a scale per
        # row of W does not (the backward sums over W's rows).
        ctx.save_for_backward(weight, w_scale if not rowwise else None)
        out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t().contiguous(), out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        weight, w_scale = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        # gradients span a wider range: e5m2 with one scale (torchao's tensorwise recipe), e4m3 by rows
        g8, g_scale = _to_float8(rows, torch.float8_e4m3fn if ctx.rowwise else torch.float8_e5m2, ctx.rowwise, dim=-1)
        if w_scale is None:
            w8, w_scale = _to_float8(weight, torch.float8_e4m3fn, True, dim=0)
        else:
            w8 = scale_to_float8(weight, w_scale.reciprocal(), torch.float8_e4m3fn)
        # _scaled_mm takes its second operand column-major: W [out, in] stored transposed
        grad_x = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=g_scale, scale_b=w_scale, out_dtype=grad.dtype)
        return grad_x.reshape(*grad.shape[:-1], weight.shape[1]), None, None


def frozen_float8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """F.linear(x, weight) without bias for a frozen `weight`, its matmuls in float8 (`recipe`:
    precision.float8's tensorwise or rowwise scales)."""
    return _FrozenFloat8Matmul.apply(x, weight, recipe == "rowwise")


def scale_to_float8(weight: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """A float32 weight shard in float8 at a precomputed scale, as torchao casts it for the float8
    all-gather: multiplied by the scale in float32, saturated to the float8 range, rounded. (The
    clamp is torchao's too: before torch 2.12, the GPUs' torch, an eager cast did not saturate.)"""
    limit = torch.finfo(float8_dtype).max
    return (weight.to(torch.float32) * scale).clamp(-limit, limit).to(float8_dtype)


def fuse_weight_casts() -> None:
    """Cast each tensorwise weight shard for its float8 all-gather in one compiled kernel.

    torchao computes scale_to_float8 eagerly, in three kernels that each stream the float32 shard
    (multiply, clamp, cast), before every all-gather: the forward's and the backward's, every
    block. On 2 x H100 (P-7B) that was 95 ms of a 705 ms traced step on FSDP's all-gather copy-in
    stream, competing with the compute for memory bandwidth; fused, the step ran 4.8% faster
    (docs/BENCHMARKS.md). Compiled, the shard is read once and the float8 copy written once: the
    same bytes (tests/integration/test_float8.py). Replaces the method of torchao's weight class, the only place
    FSDP2 asks for the all-gather's input; before the first precomputed scale torchao's own path
    (amax, then cast) still runs."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    if getattr(Weight.fsdp_pre_all_gather, "fused", False):
        return
    torchao_pre_all_gather, cast = Weight.fsdp_pre_all_gather, torch.compile(scale_to_float8, dynamic=True)
    # FSDP2 calls the method by its signature; torchao 0.18's takes the mesh only.
    assert list(inspect.signature(torchao_pre_all_gather).parameters) == ["self", "mesh"], \
        "torchao's fsdp_pre_all_gather changed: sft/parallel/float8.py:fuse_weight_casts must follow it"

    def fsdp_pre_all_gather(self, mesh):
        scale = self._precomputed_scale
        if scale is None:
            return torchao_pre_all_gather(self, mesh)
        return (cast(self._tensor, scale, self._dtype),), (scale,)

    fsdp_pre_all_gather.fused = True
    Weight.fsdp_pre_all_gather = fsdp_pre_all_gather


def precompute_scales_after_each_step(optimizer: torch.optim.Optimizer, model: nn.Module, recipe: str,
                                      lora: LoRA | None = None) -> None:
    """Make `precompute_float8_scales` an optimizer post-step hook, where it does anything: it must
    follow every step, the next step's float8 all-gathers use the scales it computes. Register it once
    the weights are loaded: DCP's restore of an optimizer state runs a step (of lr 0) first, when the
    weights may still be uninitialised memory, and a scale computed then would be used once."""
    if recipe == "tensorwise" and not lora:
        optimizer.register_step_post_hook(lambda *_: precompute_float8_scales(model, recipe))


def precompute_float8_scales(model: nn.Module, recipe: str) -> None:
    """After every optimizer step (precompute_scales_after_each_step): with tensorwise scaling,
    compute the float8 scales of all sharded weights in one all-reduce, for the next step's float8
    all-gathers (otherwise each all-gather computes its own: one small all-reduce per weight). Once
    called, it must follow every step: the all-gathers keep using the last precomputed scale. No-op
    for other recipes. Not with LoRA: its frozen weights all-gather in bf16 and are cast in each
    matmul."""
    if recipe == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
