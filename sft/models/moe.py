"""Mixture-of-Experts blocks: routing, dropless experts on grouped GEMMs, the load-balancing loss and
expert-load statistics. (The hub's per-expert layout of their weights: sft/models/hub.py.)

Supported: the transformers 5 sparse blocks of Qwen3-MoE and Mixtral (softmax top-k router `gate`,
fused experts `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]) and gpt-oss (router
`router` with a bias and a softmax over the top-k logits; experts transposed [E, H, 2I] / [E, I, H],
gate/up interleaved, biases, a clamped SwiGLU): `LAYOUTS` (sft/models/moe_layouts.py). `apply_moe`
puts a `SparseMoE` of ours in each such block's place: it holds the block's router and experts under their own names (so
parameter names, checkpoints and hub files are the model's) and computes it:

* routes in float32 (moe.router_fp32): logits, softmax and top-k from the gathered router weight;
* sorts the (token, slot) pairs by expert and runs each expert's SwiGLU on its rows
  (`GroupedExperts`, which owns the expert weights) with `grouped_mm` on the gathered weights
  (bf16 under fsdp.param_dtype=bfloat16, never the masters). Group sizes come from `searchsorted` on
  the device: no host sync, no capacity,
  no dropped token, and every shape depends only on the number of tokens, so a compiled block sees
  one graph (dynamic in the token count) and no graph break. Where the kernel cannot run (float32
  weights, e.g. the CPU tests; rows not 16-byte aligned), `_per_expert_linear` loops over the
  experts with the same sorted rows (a host sync; excluded from compile). Under expert
  parallelism (moe.ep_degree) the sorted rows travel to the rank holding their expert and back:
  sft/parallel/expert_parallel.py;
* adds the load-balancing loss's gradient without returning it (`_AddAuxLossGrad`), and keeps the
  step's expert loads for the metrics.

`apply_moe` returns the `MoE` handle the recipe passes to whatever needs the experts: parallelize
(their FSDP placement; activation checkpointing must not re-route, so the top-k op's outputs are
saved under every policy: `MoE.kept_ops`, so recomputation reuses the forward's choice), the loss
(the load-balancing term's per-step scale and per-micro-batch mask) and the metrics (expert loads,
active parameters).

The load-balancing loss (Switch Transformer, as transformers computes it for these models) of one
layer over a set of tokens is  E * sum_e f_e * P_e,  f_e = (top-k slots routed to e) / tokens and
P_e = mean router probability of e; f carries no gradient. Here the set is each micro-batch's *real*
tokens (padding excluded, documents of a packed row included: a packed row and the same documents
padded give the same statistics), the layers are averaged, and each micro-batch's value is weighted
by its share of the step's real tokens, counted over all ranks before the first forward:

    aux = coef * (1/L) * sum_layers sum_micro-batches (T_mb / T_step) * E * sum_e f_e P_e

So the total is invariant to how the same micro-batches fall on ranks and grad-accum steps (FSDP
sums gradients; no factor of world size), and equals transformers' own term for one micro-batch and
one MoE layer. The balancing set is what one forward sees, as in transformers: another
train.micro_batch_size changes it (f and P are products over the set, not sums). transformers pools f
and P over all layers before the product (expert e of layer 1
and of layer 2 share a statistic); we balance each layer, as Switch, Megatron and TorchTitan do.
Balancing over the whole global batch (the Qwen3 authors' recommendation) would need every
micro-batch's counts before the first backward: a second forward, not done.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import Shard

from sft.config import MoEConfig
from sft.distributed import local_part
from sft.errors import UserError
from sft.models.moe_layouts import LAYOUTS, ExpertLayout


class MoEError(UserError):
    """A mixture-of-experts model that cannot be trained as it is; the message names the fix."""


def _sparse_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module holding fused experts (`experts.gate_up_proj`), any layout."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(getattr(module, "experts", None), "gate_up_proj", None), nn.Parameter)]


def expert_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(experts per block, experts per token, expert intermediate size), None for a dense model;
    any fused layout (the planner also sizes architectures apply_moe does not train)."""
    sparse = _sparse_modules(model)
    if not sparse:
        return None
    config = model.config.get_text_config()
    gate_up = sparse[0][1].experts.gate_up_proj  # [E, 2I, H] or transposed [E, H, 2I]
    return gate_up.shape[0], config.num_experts_per_tok, gate_up.numel() // (2 * gate_up.shape[0] * config.hidden_size)


def _moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the sparse MoE modules of `model` (none for a dense model); one clear error
    for an architecture whose experts this module does not know (e.g. shared experts: Qwen2-MoE)."""
    sparse = _sparse_modules(model)
    model_type = model.config.get_text_config().model_type
    if sparse and model_type not in LAYOUTS:
        raise MoEError(f"{type(model).__name__} (model_type {model_type}): mixture-of-experts blocks of this "
                       f"architecture are not supported; supported: {', '.join(sorted(LAYOUTS))}")
    return sparse


def _grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> bool:
    """Whether the grouped GEMM kernel takes these operands: bf16 (float32 runs a slow fallback on
    GPUs and is not compilable on CPU) and 16-byte aligned rows of input and output."""
    return x.dtype == weight.dtype == torch.bfloat16 and x.shape[-1] * 2 % 16 == 0 and out_features * 2 % 16 == 0


@torch.compiler.disable  # data-dependent slicing: runs eagerly (a graph break) rather than recompiling
def _per_expert_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [ends[e-1], ends[e]) of x times weight[e] ([in, out]), expert by expert (the fallback)."""
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        out.append(x[start:end] @ weight[e])
        start = end
    return torch.cat(out)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """x [rows, in] sorted by expert times weight [E, out, in] (transposed: [E, in, out]);
    ends[e] = end row of expert e (int32)."""
    weight = weight if transposed else weight.transpose(-2, -1)  # [E, in, out]: a view
    if _grouped_mm_runs(x, weight, weight.shape[-1]):
        grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # F.grouped_mm from torch 2.10
        return grouped_mm(x, weight, offs=ends)
    return _per_expert_linear(x, weight, ends)


class GroupedExperts(nn.Module):
    """A block's experts, run on rows sorted by expert. It takes over the Hugging Face module's
    weights under their own names (`gate_up_proj`, `down_proj`, gpt-oss's biases), so parameter
    names, checkpoints and hub files stay the model's. A module of its own, called once the rows
    are sorted (and, under expert parallelism, have arrived), so that FSDP can gather its weights
    then, over the ranks that shard them."""

    def __init__(self, experts: nn.Module, layout: ExpertLayout):
        super().__init__()
        for name, param in experts.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.layout = layout
        if layout.interleaved:  # gpt-oss's clamped SwiGLU
            self.limit, self.alpha = experts.limit, getattr(experts, "alpha", 1.702)
        else:
            self.act_fn = experts.act_fn

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.layout.interleaved:  # gpt-oss: gate/up interleaved, clamped, (up + 1) * gate * sigmoid(alpha gate)
            gate = gate_up[..., ::2].clamp(max=self.limit)
            up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
            return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, rows: torch.Tensor, expert_ids: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Each row through its expert's SwiGLU: rows sorted by (this rank's) expert, `expert_ids`
        their experts, `ends[e]` the end row of expert e (int32)."""
        # Under expert parallelism the gathered weights are DTensors over the ep ranks, sharded by
        # expert (sft/parallel/expert_parallel.py): their local part is this rank's experts.
        transposed = self.layout.transposed
        gate_up = grouped_linear(rows, local_part(self.gate_up_proj), ends, transposed)
        if self.layout.biased:
            gate_up = gate_up + local_part(self.gate_up_proj_bias)[expert_ids]
        out = grouped_linear(self._glu(gate_up), local_part(self.down_proj), ends, transposed)
        if self.layout.biased:
            out = out + local_part(self.down_proj_bias)[expert_ids]
        return out


def eager_expert_widths(model: nn.Module) -> int:
    """Expert-intermediate-wide tensors per routed row that the experts keep for their backward when
    they run eagerly, as under expert parallelism (outside the compiled block): their gate_up output,
    what the activation saves (SiLU-gated: 1; gpt-oss's clamped SwiGLU: 4) and the down projection's
    input. Counted by running the activation on a few rows; 0 for a dense model or an architecture
    apply_moe does not train."""
    sparse = _sparse_modules(model)
    model_type = model.config.get_text_config().model_type
    if not sparse or model_type not in LAYOUTS:
        return 0
    experts = GroupedExperts(sparse[0][1].experts, LAYOUTS[model_type])
    rows, width = 4, 8
    gate_up = torch.randn(rows, 2 * width, requires_grad=True) * 1  # a tensor of its own, as gate_up is
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        experts._glu(gate_up)
    # a view of it may be saved
    saved.setdefault(gate_up.untyped_storage().data_ptr(), gate_up.untyped_storage().nbytes())
    return sum(saved.values()) // (rows * width * 4) + 1  # + the down projection's input


def expert_ends(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ends[e] = the end row of expert e in rows sorted by expert (int32, on the device: no sync)."""
    experts = torch.arange(1, num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts).to(torch.int32)


def run_local_experts(experts: GroupedExperts, rows: torch.Tensor, sorted_ids: torch.Tensor,
                      num_experts: int) -> torch.Tensor:
    """Rows sorted by expert through their experts, all of which this rank holds."""
    return experts(rows, sorted_ids, expert_ends(sorted_ids, num_experts))


def expert_outputs(experts: GroupedExperts, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
                   num_experts: int, run_experts=run_local_experts) -> torch.Tensor:
    """sum_k top_w[t, k] * expert_{top_i[t, k]}(x[t]) for every token t, dropless. `run_experts`
    takes the rows sorted by expert to their experts and back (here, or across the ep ranks)."""
    tokens, k = top_i.shape
    # Stable sort: within an expert, rows keep token order, so results do not depend on the sort.
    sorted_ids, order = top_i.reshape(-1).sort(stable=True)
    rows = x.unsqueeze(1).expand(tokens, k, x.shape[-1]).reshape(tokens * k, -1)[order]
    out_sorted = run_experts(experts, rows, sorted_ids, num_experts)
    # Back to (token, slot) order with a permutation (no atomics), then a sum over the k slots.
    out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)
    return (out.view(tokens, k, -1) * top_w.unsqueeze(-1)).sum(dim=1)


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


class SparseMoE(nn.Module):
    """One sparse MoE block, computed by us. It holds the Hugging Face block's router and experts,
    registered under their own names (`gate` or `router`, `experts`), so the model's parameter names
    are unchanged; their weights are what FSDP gathers. Per micro-batch the `MoE` handle sets
    `real_tokens` (float [T]: 1 a real token, 0 padding; kept for a checkpointed block's
    recomputation) and per step `aux_scale`; each forward leaves `stats` (aux term, expert loads)."""

    def __init__(self, block: nn.Module, layout: ExpertLayout, top_k: int, norm_topk: bool, router_fp32: bool):
        super().__init__()
        children = {name for name, _ in block.named_children()}
        if children != {layout.router, "experts"} or any(True for _ in block.parameters(recurse=False)):
            raise MoEError(f"{type(block).__name__} holds {sorted(children)}: a sparse block of this form (besides its "
                           f"router '{layout.router}' and experts) is not supported")
        for name, child in block.named_children():  # in the block's order: the model's parameter order
            self.add_module(name, GroupedExperts(child, layout) if name == "experts" else child)
        self.layout, self.top_k, self.norm_topk, self.router_fp32 = layout, top_k, norm_topk, router_fp32
        self.num_experts = self.experts.gate_up_proj.shape[0]
        # How rows sorted by expert reach their experts: here, or across the ep ranks
        # (sft/parallel/expert_parallel.py sets it).
        self.run_experts = run_local_experts
        self.real_tokens: torch.Tensor | None = None
        self.aux_scale: torch.Tensor | None = None
        self.stats: torch.Tensor | None = None

    def _routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router probabilities [T, E] float32, top-k weights [T, K], top-k expert ids [T, K])."""
        router = self._modules[self.layout.router]  # `gate` or `router` (gpt-oss)
        bias = router.bias if self.layout.biased else None
        if self.router_fp32:
            logits = F.linear(x.float(), router.weight.float(), None if bias is None else bias.float())
        else:
            logits = F.linear(x, router.weight, bias)
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # what the load-balancing loss averages
        if self.layout.softmax_of_top_k:  # gpt-oss
            top_logits, top_i = logits.topk(self.top_k, dim=-1)
            top_w = top_logits.softmax(dim=-1, dtype=torch.float32)
        else:
            top_w, top_i = probs.topk(self.top_k, dim=-1)
            if self.norm_topk:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs, top_w.to(x.dtype), top_i

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs, top_w, top_i = self._routing(x)
        out = expert_outputs(self.experts, x, top_w, top_i, self.num_experts, self.run_experts)
        real = self.real_tokens
        if real is not None and torch.is_grad_enabled():
            num_experts = probs.shape[-1]
            tokens = real.sum().clamp(min=1)
            load = torch.zeros(num_experts, dtype=torch.float32, device=x.device).scatter_add_(
                0, top_i.reshape(-1), real.repeat_interleave(top_i.shape[1]))
            prob_sum = (probs * real.unsqueeze(-1)).sum(dim=0)
            # (T_mb / T_step) * coef/L * E * sum_e (load_e / T_mb) * (prob_sum_e / T_mb); scale = coef/(L * T_step)
            aux = self.aux_scale * num_experts * (load * prob_sum).sum() / tokens
            out = _AddAuxLossGrad.apply(out, aux)
            # For the metrics; under compile with checkpointing this side effect is not replayed in
            # recomputation (skip_fwd_side_effects_in_bwd_under_checkpoint, set in apply_moe).
            self.stats = torch.cat([aux.detach().view(1), load])
        if self.layout.returns_scores:  # gpt-oss's decoder layer unpacks (hidden states, router scores)
            return out.reshape(shape), top_w
        return out.reshape(shape)


def apply_moe(model: nn.Module, cfg: MoEConfig) -> MoE | None:
    """Put a SparseMoE in the place of each MoE block of a (meta-device) model and give the routers
    their switches; return the handle the recipe passes on, None for a dense model."""
    sparse = _moe_blocks(model)
    if not sparse:
        if cfg.ep_degree > 1:
            raise MoEError(f"moe.ep_degree={cfg.ep_degree}: {type(model).__name__} has no mixture-of-experts blocks; "
                           "set moe.ep_degree=1")
        return None
    config = model.config.get_text_config()
    num_experts = sparse[0][1].experts.gate_up_proj.shape[0]
    if num_experts % cfg.ep_degree:
        raise MoEError(f"moe.ep_degree={cfg.ep_degree}: must divide the {num_experts} experts of each MoE block")
    if getattr(config, "router_jitter_noise", 0):
        raise MoEError(f"{type(model).__name__}: router_jitter_noise={config.router_jitter_noise} in config.json "
                       "makes routing random, which checkpoint recomputation cannot replay; set it to 0")
    active = active_parameters(model)
    layout = LAYOUTS[config.model_type]
    blocks = []
    for name, block in sparse:
        getattr(block, layout.router).requires_grad_(cfg.train_router)
        ours = SparseMoE(block, layout, config.num_experts_per_tok,
                         getattr(config, "norm_topk_prob", True),  # Mixtral always renormalises
                         cfg.router_fp32)
        model.set_submodule(name, ours)
        blocks.append(ours)
    # The block's statistics for the metrics are a forward side effect; compiled checkpointed blocks
    # would otherwise graph-break on it (torch 2.11+; older versions run the region eagerly).
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    coef = cfg.aux_loss_coef if cfg.aux_loss_coef is not None else getattr(config, "router_aux_loss_coef", 0.0)
    return MoE(blocks, coef, active)


def active_parameters(model: nn.Module) -> int:
    """Parameters one token's forward uses: all, less the experts it is not routed to (= all for a
    dense model). The MFU numerator counts these (6 x active parameters per token)."""
    total = sum(p.numel() for p in model.parameters())
    config = model.config.get_text_config()
    for _, module in _sparse_modules(model):
        experts = sum(p.numel() for p in module.experts.parameters())  # weights (and gpt-oss's biases)
        total -= experts * (1 - config.num_experts_per_tok / module.experts.gate_up_proj.shape[0])
    return int(total)


class MoE:
    """The model's mixture-of-experts blocks, as the rest of the trainer needs them.

    The loss, per step: `begin_step(global real tokens)`; per micro-batch `begin_micro_batch(real-
    token mask)` before its forward and `end_micro_batch()` after it (before its backward). The
    metrics all-reduce `step_stats()` once the step is done and log its `summary`, with MFU counted
    on `active_parameters`. Parallelize shards the experts by `shard_placement` and keeps
    `kept_ops`' outputs under activation checkpointing."""

    # Ops whose outputs every checkpointing policy keeps: the top-k, the routing decision, which
    # recomputation must reuse. (Not expert parallelism's all-to-alls: recomputation sends the rows
    # again, as keeping what arrived would cost 2 x top_k x hidden bf16 per token and block, the
    # block's whole MoE activations; measured, the whole Qwen3-30B-A3B ran out of memory.)
    kept_ops = frozenset((torch.ops.aten.topk.default,))

    def __init__(self, blocks: list[SparseMoE], coef: float, active_parameters: int):
        self.blocks, self.coef, self.active_parameters = blocks, coef, active_parameters
        self._scale: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None  # [layers, 1 + E]: aux term, expert loads

    @staticmethod
    def shard_placement(shard_ranks: int, ep: int = 1):
        """FSDP2 shard_placement_fn: expert weights on the expert dim (Shard(0)) when a rank's
        experts (all of them, or 1/ep under expert parallelism) are at least as many as the ranks
        that shard them, else on their output rows (Shard(1)), so no rank holds an empty shard."""
        def placement(param: nn.Parameter) -> Shard | None:
            if param.dim() == 3 and param.shape[0] // ep < shard_ranks:
                return Shard(1)
            return None  # FSDP's default, Shard(0)
        return placement

    def begin_step(self, real_tokens: torch.Tensor) -> None:
        self._scale = self.coef / (len(self.blocks) * real_tokens.float().clamp(min=1))
        self._stats = None

    def begin_micro_batch(self, real: torch.Tensor) -> None:
        mask = real.reshape(-1).float()
        for block in self.blocks:
            block.real_tokens, block.aux_scale = mask, self._scale

    def end_micro_batch(self) -> None:
        # The mask stays on the blocks: a checkpointed block's recomputation in backward needs it too.
        stats = torch.stack([block.stats for block in self.blocks])
        self._stats = stats if self._stats is None else self._stats + stats

    def step_stats(self) -> torch.Tensor:
        """This rank's [layers, 1 + E] sums over the step (to be all-reduced by the caller)."""
        return self._stats

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
