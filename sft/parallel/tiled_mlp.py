"""Tiled MLPs for long rows (ac.mlp_tile_tokens): each dense MLP of the decoder blocks runs a row's
tokens a tile at a time and keeps only its input for backward, where it reruns each tile's forward
and backward in turn. The MLP's intermediates (gate and up projections, their product: 3 x the FFN
width per token, the widest activations of a block) then never exist for the whole row, in the
forward, in a checkpointed block's recomputation or in its backward: at long rows a block's peak is
attention's and the checkpoints', not the MLP's (Arctic Long Sequence Training's TiledMLP).

The same computation as the untiled MLP (it treats tokens one by one; dropout inside it draws the
forward's masks again, from the random state the forward started with), up to rounding: each tile's
weight gradient is rounded to the weight's dtype before the tiles are summed, and float8 scales its
inputs per tile. Costs one more forward of the MLP a step. Rows no longer than a tile take the MLP's
own forward, compiled as before; where a row is longer, the tiles' backward is Python (a graph
break): a checkpointed block then runs eagerly, attention included, a block without checkpointing as
two compiled graphs around its MLP. Mixture-of-experts blocks are left as they are (their experts see
a row's tokens sorted by expert, not by position); an MLP called with more than the hidden states
(BLOOM's) is refused.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from sft.config import ConfigError
from sft.distributed import log0
from sft.models.architecture import become


class _TiledMLP(torch.autograd.Function):
    """`mlp`(x) along dim 1 in tiles of `tile` tokens; `params`: the MLP's trained parameters (their
    gradients come from each tile's backward). Saves x and the random state the tiles started from."""

    @staticmethod
    def forward(ctx, mlp: nn.Module, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp, ctx.tile, ctx.params = mlp, tile, params
        ctx.cpu_rng, ctx.device_rng = torch.get_rng_state(), get_device_states(x)
        ctx.save_for_backward(x)
        with torch.no_grad():
            # contiguous: a tile of several rows is a strided view, which some MLPs view as 2-D (GPT-2's Conv1D)
            return torch.cat([mlp.untiled_forward(part.contiguous()) for part in x.split(tile, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        wanted = ctx.needs_input_grad[2]
        grad_x, grad_params = [], [None] * len(ctx.params)
        devices, states = ctx.device_rng
        # The tiles again in the forward's order from its random state: dropout draws the same masks
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            set_device_states(devices, states)
            for part, grad_part in zip(x.split(ctx.tile, dim=1), grad.split(ctx.tile, dim=1)):
                part = part.detach().contiguous().requires_grad_(wanted)
                with torch.enable_grad():
                    out = ctx.mlp.untiled_forward(part)
                grads = torch.autograd.grad(out, ((part,) if wanted else ()) + ctx.params, grad_part,
                                            allow_unused=True)
                if wanted:
                    grad_x.append(grads[0])
                # summed in the weights' dtype, as gradient accumulation over micro-batches is
                grad_params = [total if g is None else g if total is None else total.add_(g)
                               for total, g in zip(grad_params, grads[1:] if wanted else grads)]
        return (None, None, torch.cat(grad_x, dim=1) if wanted else None, *grad_params)


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


def tiling_refusal(blocks: list[nn.Module]) -> str | None:
    """Why the MLPs of `blocks` cannot be tiled (what follows "ac.mlp_tile_tokens=N: "), or None. The
    planner asks too, so that plan.auto never tiles what the build refuses."""
    mlps = dense_mlps(blocks)
    if not mlps:
        return "the decoder blocks have no dense MLP (an `mlp` module that is not a mixture-of-experts block) to tile"
    taken = [name for name in inspect.signature(type(mlps[0]).forward).parameters if name != "self"]
    if len(taken) != 1:
        return f"{type(mlps[0]).__name__} takes {', '.join(taken)}, not the hidden states alone, so it cannot be tiled"
    return None


def apply_mlp_tiling(blocks: list[nn.Module], tile_tokens: int) -> None:
    """Tile the dense MLPs of `blocks` (each becomes an instance of a subclass of its own class, so
    parameter names stay the model's); one error where they cannot be tiled (tiling_refusal)."""
    if refusal := tiling_refusal(blocks):
        raise ConfigError(f"ac.mlp_tile_tokens={tile_tokens}: {refusal}; set ac.mlp_tile_tokens=0")
    mlps = dense_mlps(blocks)
    for mlp in mlps:
        become(mlp, TiledMLP)
        mlp.tile_tokens = tile_tokens
    log0(f"tiled {len(mlps)} MLPs along the row, {tile_tokens} tokens at a time")
