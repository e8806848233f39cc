"""Tiled MLPs for long rows (ac.mlp_tile_tokens): each dense MLP of the decoder blocks runs a row's
tokens a tile at a time and keeps only its input for backward, where it reruns each tile's forward
and backward in turn. The MLP's intermediates (gate and up projections, their product: 3 x the FFN
width per token, the widest activations of a block) then never exist for the whole row, in the
forward, in a checkpointed block's recomputation or in its backward: at long rows a block's peak is
attention's and the checkpoints', not the MLP's (Arctic Long Sequence Training's TiledMLP).

Exact (the MLP treats tokens one by one), for one more forward of the MLP a step. Rows no longer
than a tile take the MLP's own forward, compiled as before; a longer row's MLP runs eagerly inside
the compiled block (a graph break), as its backward reruns Python. Mixture-of-experts blocks are
left as they are (their experts see a row's tokens sorted by expert, not by position).
"""

from __future__ import annotations

import torch
from torch import nn

from sft.config import ConfigError
from sft.distributed import log0
from sft.models.moe import become


class _TiledMLP(torch.autograd.Function):
    """`mlp`(x) along dim 1 in tiles of `tile` tokens; `params`: the MLP's trained parameters (their
    gradients come from each tile's backward). Saves x alone."""

    @staticmethod
    def forward(ctx, mlp: nn.Module, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp, ctx.tile, ctx.params = mlp, tile, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([mlp.untiled_forward(part) for part in x.split(tile, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        # The weights' gradients summed over the tiles in float32, as one matmul over the row accumulates
        grad_x, grad_params = [], [None] * len(ctx.params)
        for part, grad_part in zip(x.split(ctx.tile, dim=1), grad.split(ctx.tile, dim=1)):
            part = part.detach().requires_grad_(True)
            with torch.enable_grad():
                out = ctx.mlp.untiled_forward(part)
            grads = torch.autograd.grad(out, (part, *ctx.params), grad_part, allow_unused=True)
            grad_x.append(grads[0])
            grad_params = [total if g is None else g.float() if total is None else total.add_(g)
                           for total, g in zip(grad_params, grads[1:])]
        grad_params = [None if total is None else total.to(p.dtype) for total, p in zip(grad_params, ctx.params)]
        return (None, None, torch.cat(grad_x, dim=1), *grad_params)


@torch.compiler.disable  # a Python loop with a backward of its own: eager (a graph break) where it tiles
def _tiled(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _TiledMLP.apply(mlp, mlp.tile_tokens, x, *[p for p in mlp.parameters() if p.requires_grad])


class TiledMLP:
    """The model's MLP, its forward tiled along the row where the row is longer than a tile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] <= self.tile_tokens:
            return self.untiled_forward(x)
        return _tiled(self, x)

    def untiled_forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)



def dense_mlps(blocks: list[nn.Module]) -> list[nn.Module]:
    """Each block's MLP (its `mlp` child) where it is dense: not a mixture-of-experts block."""
    return [block.mlp for block in blocks if isinstance(getattr(block, "mlp", None), nn.Module)
            and not hasattr(block.mlp, "experts")]


def apply_mlp_tiling(blocks: list[nn.Module], tile_tokens: int) -> None:
    """Tile the dense MLPs of `blocks` (each becomes an instance of a subclass of its own class, so
    parameter names stay the model's); one error where the blocks have none."""
    mlps = dense_mlps(blocks)
    if not mlps:
        raise ConfigError(f"ac.mlp_tile_tokens={tile_tokens}: the decoder blocks have no dense MLP to tile (their "
                          "MLPs are mixture-of-experts blocks); set ac.mlp_tile_tokens=0")
    for mlp in mlps:
        become(mlp, TiledMLP)
        mlp.tile_tokens = tile_tokens
    log0(f"tiled {len(mlps)} MLPs along the row, {tile_tokens} tokens at a time")
