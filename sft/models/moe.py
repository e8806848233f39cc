"""Mixture-of-Experts blocks: transformers' own routing, dropless experts on grouped GEMMs, the
load-balancing loss, expert-load statistics and the correction bias of bias-balanced routers.

Any sparse block transformers ships whose experts follow its experts interface (fused
`experts.gate_up_proj` / `experts.down_proj`, marked by `use_experts_implementation`; every MoE
family of docs/moe.md but the general path's) takes our path. `apply_moe` keeps each such block
as transformers wrote it (its router, shared experts, gates, dense first layers) and changes three
things in place, each by a subclass of the module's own class (as FSDP2 does), so parameter names,
checkpoints and hub files stay the model's:

* the experts (`GroupedExperts`) sort the (token, slot) pairs by expert and run each expert's rows
  with `grouped_mm` on the gathered weights (bf16 under fsdp.param_dtype=bfloat16, never the
  masters): no host sync, no capacity, no dropped token, one compiled graph (sft/models/experts.py).
  Under expert parallelism (moe.ep_degree) the sorted rows travel to the rank holding their expert
  and back: sft/parallel/expert_parallel.py;
* the router (`KeepsRouterLogits`) computes as transformers does and keeps its logits;
* the block (`SparseMoE`) adds the load-balancing loss's gradient without returning it
  (`_AddAuxLossGrad`) and keeps the step's expert loads for the metrics.

Routing is exactly the reference's; a sparse block of another form (Llama-4's dense experts) takes the
general path, transformers' block as it is (docs/moe.md; the start-up line says which path).
`apply_moe` returns the `MoE` handle the recipe passes to whatever needs the experts: parallelize
(their FSDP placement; the top-k op's outputs saved under every checkpointing policy), the loss (the
load-balancing term's scale and mask), the metrics (expert loads) and the optimizer (the correction
bias of DeepSeek-V3-style routers after each step: `update_biases_after_each_step`).

The load-balancing loss is each layer's Switch term over a micro-batch's real tokens, weighted by
the micro-batch's share of the step's real tokens (why: docs/moe.md, "Load-balancing loss").
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor.placement_types import Shard
from torch.overrides import TorchFunctionMode

from sft.config import MoEConfig
from sft.errors import UserError
from sft.models.architecture import become, text_config
from sft.models.experts import GroupedExperts, expert_outputs


class MoEError(UserError):
    """A mixture-of-experts model that cannot be trained as it is; the message names the fix."""


def sparse_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module holding fused experts (`experts.gate_up_proj`), any layout."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(getattr(module, "experts", None), "gate_up_proj", None), nn.Parameter)]


def expert_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(experts per block, experts per token, expert intermediate size), None for a dense model."""
    sparse = sparse_modules(model)
    if not sparse:
        return None
    config = text_config(model.config)
    gate_up = sparse[0][1].experts.gate_up_proj  # [E, 2I, H] or transposed [E, H, 2I]
    return gate_up.shape[0], config.num_experts_per_tok, gate_up.numel() // (2 * gate_up.shape[0] * config.hidden_size)


def _router(block: nn.Module) -> str | None:
    """The name of `block`'s router: its one child besides the experts with a weight of one row per expert."""
    num_experts = block.experts.gate_up_proj.shape[0]
    found = [name for name, child in block.named_children() if name != "experts"
             and isinstance(getattr(child, "weight", None), nn.Parameter)
             and child.weight.dim() == 2 and child.weight.shape[0] == num_experts]
    return found[0] if len(found) == 1 else None


def takes_our_path(block: nn.Module) -> bool:
    """Whether `block`'s experts follow transformers' experts interface (gate and up fused, no norm
    after the experts, called with (hidden states, top-k indices, top-k weights)) and it has one
    router: what our experts compute. Another block takes the general path."""
    experts = block.experts
    interface = getattr(experts, "has_gate", False) and not getattr(experts, "has_post_expert_norm", False)
    called = len(inspect.signature(type(experts).forward).parameters) == 4  # self, hidden, indices, weights
    return bool(interface and called and _router(block))
def routed_experts(blocks: list[nn.Module]) -> list[nn.Module]:
    """The experts modules of the sparse blocks in `blocks` that take our path (their fused weights
    are what LoRA's `experts` target adapts)."""
    return [module.experts for block in blocks for _, module in sparse_modules(block) if takes_our_path(module)]


def general_path_blocks(blocks: list[nn.Module]) -> str | None:
    """The class of the sparse blocks in `blocks` that take the general path, if any."""
    return next((type(module).__name__ for block in blocks for _, module in sparse_modules(block)
                 if not takes_our_path(module)), None)


class _TopKOfItsOwn(TorchFunctionMode):
    """torch.topk's outputs as copies. Activation checkpointing keeps topk's outputs (MoE.kept_ops: the
    routing is never recomputed), and a kept tensor must not change afterwards; transformers' routers
    normalise the top-k values in place (`router_top_value /= ...`), which then changes the copy."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.topk, torch.Tensor.topk):
            return type(out)((out.values.clone(), out.indices))
        return out


class KeepsRouterLogits:
    """The model's router, computing as transformers does, keeping its logits (its output's first
    element) for the load-balancing loss."""

    def forward(self, *args, **kwargs):
        with _TopKOfItsOwn():
            out = super().forward(*args, **kwargs)
        self.router_logits = out[0]
        return out


class SparseMoE:
    """The model's sparse block, computing as transformers does (its router, our experts, its shared
    experts), with the load-balancing term and the expert loads. Per micro-batch the `MoE` handle
    sets `real_tokens` (float [T]: 1 a real token, 0 padding; kept for a checkpointed block's
    recomputation) and per step `aux_scale`; each forward leaves `stats` (aux term, this rank's
    expert loads). `cp_group`: the ranks that hold the other parts of its rows, or None."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        output = super().forward(hidden_states, *args, **kwargs)
        real = self.real_tokens
        if real is None or not torch.is_grad_enabled():
            return output
        out = output[0] if isinstance(output, tuple) else output  # gpt-oss: (hidden states, router scores)
        top_i, self.experts.top_k_index = self.experts.top_k_index, None  # not kept past the block
        router = self._modules[self.router_name]
        probs, router.router_logits = router.router_logits.float().softmax(dim=-1), None
        num_experts = probs.shape[-1]
        load = torch.zeros(num_experts, dtype=torch.float32, device=out.device).scatter_add_(
            0, top_i.reshape(-1), real.repeat_interleave(top_i.shape[1]))
        counts = torch.cat([load, real.sum().view(1)])
        if self.cp_group is not None:  # this rank holds part of each row: the term counts the whole rows
            counts = funcol.all_reduce(counts, "sum", self.cp_group)
        prob_sum = (probs * real.unsqueeze(-1)).sum(dim=0)
        # (T_mb / T_step) * coef/L * E * sum_e (load_e / T_mb) * (prob_sum_e / T_mb); scale = coef/(L * T_step).
        # Under context parallelism each rank's term has its own tokens' prob_sum: the terms sum to the rows'.
        aux = self.aux_scale * num_experts * (counts[:-1] * prob_sum).sum() / counts[-1].clamp(min=1)
        out = _AddAuxLossGrad.apply(out, aux)
        # For the metrics; under compile with checkpointing this side effect is not replayed in
        # recomputation (skip_fwd_side_effects_in_bwd_under_checkpoint, set in apply_moe).
        self.stats = torch.cat([aux.detach().view(1), load])
        return (out, *output[1:]) if isinstance(output, tuple) else out


def eager_expert_widths(model: nn.Module) -> int:
    """Expert-intermediate-wide tensors per routed row that the experts keep for their backward when
    they run eagerly, as under expert parallelism (outside the compiled block): their gate_up output,
    what the gate activation saves (SiLU-gated: 1; gpt-oss's clamped SwiGLU: 4) and the down
    projection's input. Counted by running the model's own activation on a few rows; 0 for a dense
    model or one on the general path."""
    sparse = sparse_modules(model)
    if not sparse or not takes_our_path(sparse[0][1]):
        return 0
    experts = sparse[0][1].experts
    rows, width = 4, 8
    gate_up = torch.randn(rows, 2 * width, requires_grad=True) * 1  # a tensor of its own, as gate_up is
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        type(experts)._apply_gate(experts, gate_up)
    # a view of it may be saved
    saved.setdefault(gate_up.untyped_storage().data_ptr(), gate_up.untyped_storage().nbytes())
    return sum(saved.values()) // (rows * width * 4) + 1  # + the down projection's input


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on the block output whose backward also gives `aux` the gradient 1: the
    load-balancing term joins the loss without leaving the (compiled, checkpointed) block."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux.dtype
        # A copy, not `output` itself: compiled after a graph break (the per-expert fallback), an
        # output that is an input of the graph is rebuilt outside it and the aux gradient was lost
        # (torch 2.13, tests/unit/test_moe.py). Compiled, the copy fuses with the residual sum after it.
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, torch.ones((), dtype=ctx.aux_dtype, device=grad_output.device)


# Where DeepSeek-V3-style routers keep the bias added to their scores to choose experts (not to weigh them).
_CORRECTION_BIAS = "e_score_correction_bias"


def apply_moe(model: nn.Module, cfg: MoEConfig) -> MoE | None:
    """Make each sparse block of a (meta-device) model ours (or leave it to the general path) and
    give the routers their switches; return the handle the recipe passes on, None for a dense model."""
    sparse = sparse_modules(model)
    if not sparse:
        if cfg.ep_degree > 1:
            raise MoEError(f"moe.ep_degree={cfg.ep_degree}: {type(model).__name__} has no mixture-of-experts blocks; "
                           "set moe.ep_degree=1")
        return None
    config = text_config(model.config)
    num_experts = sparse[0][1].experts.gate_up_proj.shape[0]
    if getattr(config, "router_jitter_noise", 0):
        raise MoEError(f"{type(model).__name__}: router_jitter_noise={config.router_jitter_noise} in config.json "
                       "makes routing random, which checkpoint recomputation cannot replay; set it to 0")
    coef = cfg.aux_loss_coef if cfg.aux_loss_coef is not None else getattr(config, "router_aux_loss_coef", 0.0)
    if not all(takes_our_path(block) for _, block in sparse):
        if cfg.ep_degree > 1:
            raise MoEError(f"moe.ep_degree={cfg.ep_degree}: {type(sparse[0][1]).__name__}'s experts are not of "
                           "transformers' experts interface, which expert parallelism runs; set moe.ep_degree=1")
        if cfg.bias_update_rate:
            raise MoEError(f"moe.bias_update_rate={cfg.bias_update_rate}: {type(sparse[0][1]).__name__} blocks take "
                           "the general path, whose routing is transformers' alone; set it to 0")
        return MoE([], coef, cfg.bias_update_rate, general=type(sparse[0][1]).__name__)
    if num_experts % cfg.ep_degree:
        raise MoEError(f"moe.ep_degree={cfg.ep_degree}: must divide the {num_experts} experts of each MoE block")
    blocks = []
    for _, block in sparse:
        router_name = _router(block)
        router = block.get_submodule(router_name)
        router.requires_grad_(cfg.train_router)
        become(router, KeepsRouterLogits)
        become(block.experts, GroupedExperts)
        block.experts.outputs = expert_outputs  # across the ep ranks: sft/parallel/expert_parallel.py
        become(block, SparseMoE)
        block.router_name, block.real_tokens, block.aux_scale, block.stats = router_name, None, None, None
        block.cp_group = None
        blocks.append(block)
    # The block's statistics for the metrics are a forward side effect; compiled checkpointed blocks
    # would otherwise graph-break on it (torch 2.11+; older versions run the region eagerly).
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    moe = MoE(blocks, coef, cfg.bias_update_rate)
    if cfg.bias_update_rate and not moe.biased:
        raise MoEError(f"moe.bias_update_rate={cfg.bias_update_rate}: {type(model).__name__}'s routers have no "
                       "correction bias (e_score_correction_bias) to move; set it to 0")
    return moe


def parameters_per_token(model: nn.Module) -> tuple[int, int]:
    """(trained, frozen) parameters one token's forward runs through: all, but of each block's routed
    experts (their weights, gpt-oss's biases, LoRA's adapters) only the k of E it is routed to. The
    MFU numerator counts these (sft/training/metrics.py: flops_per_token)."""
    config = text_config(model.config)
    routed = {id(p): config.num_experts_per_tok / module.experts.num_experts
              for _, module in sparse_modules(model) for p in module.experts.parameters()}
    counts = [0.0, 0.0]
    for p in model.parameters():
        counts[not p.requires_grad] += p.numel() * routed.get(id(p), 1.0)
    return int(counts[0]), int(counts[1])


def active_parameters(model: nn.Module) -> int:
    """Parameters one token's forward uses (= all for a dense model)."""
    return sum(parameters_per_token(model))


def _correction_bias(block: nn.Module) -> torch.Tensor | None:
    """The block's correction bias (on its router: DeepSeek-V3, GLM-4.5; on the block: MiniMax-M2)."""
    router = block.get_submodule(block.router_name)
    return getattr(router, _CORRECTION_BIAS, None) if hasattr(router, _CORRECTION_BIAS) \
        else getattr(block, _CORRECTION_BIAS, None)


class MoE:
    """The model's mixture-of-experts blocks, as the rest of the trainer needs them.

    The loss, per step: `begin_step(global real tokens)`; per micro-batch `begin_micro_batch(real-
    token mask)` before its forward and `end_micro_batch()` after it (before its backward). The
    metrics all-reduce `step_stats()` once the step is done and log its `summary`. After the
    optimizer step, `step_done()` moves the correction biases. Parallelize shards the experts by
    `shard_placement` and keeps `kept_ops`' outputs under activation checkpointing. `general`: the
    class of blocks left to transformers (no statistics, no loss of ours), else None."""

    # Ops whose outputs every checkpointing policy keeps: the top-k, the routing decision, which
    # recomputation must reuse. (Not expert parallelism's all-to-alls: recomputation sends the rows
    # again, as keeping what arrived would cost 2 x top_k x hidden bf16 per token and block, the
    # block's whole MoE activations; measured, the whole Qwen3-30B-A3B ran out of memory.)
    kept_ops = frozenset((torch.ops.aten.topk.default,))

    def __init__(self, blocks: list[nn.Module], coef: float, bias_update_rate: float = 0.0, general: str | None = None):
        self.blocks, self.coef, self.general = blocks, coef, general
        # Blocks whose routers choose by a correction bias (looked up when used: materialising the
        # model gives the buffers new storage).
        self.biased = [block for block in blocks if _correction_bias(block) is not None]
        self.bias_update_rate = bias_update_rate
        self._scale: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None  # [layers, 1 + E]: aux term, expert loads

    @property
    def path(self) -> str:
        """What the start-up line says of the model's blocks."""
        if self.general:
            return (f"mixture of experts: {self.general} blocks as transformers computes them (the general path: "
                    "no load-balancing loss or expert statistics of ours, no expert parallelism)")
        bias = f"; correction bias moved at rate {self.bias_update_rate} a step" if self.biased and \
            self.bias_update_rate else ""
        return (f"mixture of experts: {len(self.blocks)} {type(self.blocks[0]).__name__} blocks on our path "
                f"(the model's routing, grouped-GEMM experts, load-balancing coefficient {self.coef}{bias})")

    @property
    def num_experts(self) -> int:
        return self.blocks[0].experts.num_experts

    @staticmethod
    def shard_placement(shard_ranks: int, ep: int = 1):
        """FSDP2 shard_placement_fn: expert weights on the expert dim (Shard(0)) when a rank's
        experts (all of them, or 1/ep under expert parallelism) are at least as many as the ranks
        that shard them, else on their output rows (Shard(1); an adapter's rank-wide dim 1 is split
        on dim 2 where it is narrower than the ranks), so no rank holds an empty shard."""
        def placement(param: nn.Parameter) -> Shard | None:
            if param.dim() == 3 and param.shape[0] // ep < shard_ranks:
                return Shard(1) if param.shape[1] >= shard_ranks else Shard(2)
            return None  # FSDP's default, Shard(0)
        return placement

    def count_rows_over(self, cp_group: str) -> None:
        """Context parallelism: each rank holds part of every row, the rest are on the ranks of
        `cp_group` (a group name); the load-balancing term counts the whole rows."""
        for block in self.blocks:
            block.cp_group = cp_group

    def begin_step(self, real_tokens: torch.Tensor) -> None:
        self._scale = self.coef / (max(len(self.blocks), 1) * real_tokens.float().clamp(min=1))
        self._stats = None

    def begin_micro_batch(self, real: torch.Tensor) -> None:
        mask = real.reshape(-1).float()
        for block in self.blocks:
            block.real_tokens, block.aux_scale = mask, self._scale

    def end_micro_batch(self) -> None:
        # The mask stays on the blocks: a checkpointed block's recomputation in backward needs it too.
        if self.blocks:
            stats = torch.stack([block.stats for block in self.blocks])
            self._stats = stats if self._stats is None else self._stats + stats

    def step_stats(self) -> torch.Tensor | None:
        """This rank's [layers, 1 + E] sums over the step (to be all-reduced by the caller); None on
        the general path."""
        return self._stats

    def update_biases_after_each_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `step_done` an optimizer post-step hook, where there is a correction bias to move.
        Register it once the weights are loaded: DCP's restore of an optimizer state runs a step."""
        if self.biased and self.bias_update_rate:
            optimizer.register_step_post_hook(lambda *_: self.step_done())

    def step_done(self) -> None:
        """After the optimizer step: each correction bias moves by moe.bias_update_rate towards the
        experts that got fewer tokens than the mean over the whole step (all ranks), up for those,
        down for the others (DeepSeek-V3's auxiliary-loss-free balancing). On the device: no sync."""
        if not (self.biased and self.bias_update_rate and self._stats is not None):
            return
        load = self._stats[:, 1:].clone()
        if dist.is_initialized():
            dist.all_reduce(load)
        with torch.no_grad():
            for block, layer in zip(self.blocks, load):
                if (bias := _correction_bias(block)) is not None:
                    bias.add_(self.bias_update_rate * torch.sign(layer.mean() - layer).to(bias.dtype))

    @staticmethod
    def summary(stats: torch.Tensor) -> dict:
        """metrics.jsonl fields from the global [layers, 1 + E] sums: the aux loss and, per layer,
        the expert load's coefficient of variation, max/mean and number of experts that got no token."""
        aux, load = stats[:, 0], stats[:, 1:].double()
        mean = load.mean(dim=1)
        return {"aux_loss": aux.sum().item(),
                "expert_load_cv": (load.std(dim=1, unbiased=False) / mean).tolist(),
                "expert_load_max_over_mean": (load.max(dim=1).values / mean).tolist(),
                "dead_experts": (load == 0).sum(dim=1).tolist()}
