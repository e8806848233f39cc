"""Dropless experts on grouped GEMMs: the (token, slot) pairs sorted by expert, each expert's rows
through its SwiGLU with `grouped_mm` on the gathered weights, the weighted sum back in token order.
sft/models/moe.py puts `GroupedExperts` on each sparse block's experts; under expert parallelism
the sorted rows travel to their experts' ranks (sft/parallel/expert_parallel.py).

Group sizes come from `searchsorted` on the device: no host sync, no capacity, no dropped token, one
compiled graph (shapes depend only on the number of tokens). Where the kernel cannot run (float32 weights,
e.g. the CPU tests; rows not 16-byte aligned), `_per_expert_linear` loops over the experts (a host sync,
outside compile)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sft.distributed import local_part
from sft.models.nf4 import dequantized, full_shape, is_nf4

# The fused expert weights of transformers' experts interface, in the order its classes define them
# (PEFT nests its adapters of them in this order: sft/adapters/peft_format.py).
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


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


class GroupedExperts:
    """What our experts compute, on top of the model's own experts class (its weights, layout flags
    and gate activation: transformers' experts interface). Called as transformers calls its experts,
    (hidden states [T, H], top-k expert ids [T, K], top-k weights [T, K]) -> [T, H]; the rows sorted
    by expert reach their experts through `outputs` (`expert_outputs` here, or across the ep ranks),
    which call `compute`. A module of its own, so FSDP can gather its weights over the ranks that shard them."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        self.top_k_index = top_k_index  # for the block's statistics
        return self.outputs(self, hidden_states, top_k_weights.to(hidden_states.dtype), top_k_index)

    def compute(self, rows: torch.Tensor, expert_ids: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Each row through its expert: rows sorted by (this rank's) expert, `expert_ids` their
        experts, `ends[e]` the end row of expert e (int32)."""
        gate_up = self._project("gate_up_proj", rows, expert_ids, ends)
        return self._project("down_proj", self._apply_gate(gate_up), expert_ids, ends)

    def _project(self, name: str, rows: torch.Tensor, expert_ids: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Rows through fused expert weight `name`: its bias where the model has one, its LoRA
        adapters where lora.target_modules names the experts (`<name>_lora`, sft/adapters/lora.py)."""
        # Under expert parallelism the gathered weights are DTensors over the ep ranks, sharded by
        # expert (sft/parallel/expert_parallel.py): their local part is this rank's experts.
        weight = getattr(self, name)
        if is_nf4(weight) and torch.compiler.is_compiling():
            # QLoRA (lora.base: nf4; whole on every rank, never under expert parallelism). Compiled,
            # the partitioner would keep the dequantised weight for the backward unless its
            # dequantisation is checkpointed (as LoRALinear's); eager, the function below keeps only NF4.
            full = checkpoint(dequantized, weight, rows.dtype, full_shape(self, name), use_reentrant=False)
            out = grouped_linear(rows, full, ends, self.is_transposed)
        elif is_nf4(weight):
            out = _FrozenNF4GroupedLinear.apply(rows, weight, full_shape(self, name), ends, self.is_transposed)
        else:
            out = grouped_linear(rows, local_part(weight), ends, self.is_transposed)
        if self.has_bias:
            out = out + local_part(getattr(self, f"{name}_bias"))[expert_ids]
        if (adapter := self._modules.get(f"{name}_lora")) is not None:
            out = out + adapter(rows, ends)
        return out


class _FrozenNF4GroupedLinear(torch.autograd.Function):
    """grouped_linear with a frozen NF4 expert weight, dequantised in the forward and again in the
    backward for the rows' gradient: only the 4-bit weight is kept between them (a bf16 copy of
    every block's experts would be QLoRA's saving gone), and the weight gets no gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, shape: torch.Size, ends: torch.Tensor,
                transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(weight, ends)
        ctx.shape, ctx.transposed = shape, transposed
        return grouped_linear(rows, dequantized(weight, rows.dtype, shape), ends, transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, ends = ctx.saved_tensors
        # d(rows) = grad times each expert's weight the other way round
        full = dequantized(weight, grad.dtype, ctx.shape)
        return grouped_linear(grad, full, ends, not ctx.transposed), None, None, None, None


def expert_ends(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ends[e] = the end row of expert e in rows sorted by expert (int32, on the device: no sync)."""
    experts = torch.arange(1, num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts).to(torch.int32)


def run_local_experts(experts: GroupedExperts, rows: torch.Tensor, sorted_ids: torch.Tensor,
                      num_experts: int) -> torch.Tensor:
    """Rows sorted by expert through their experts, all of which this rank holds."""
    return experts.compute(rows, sorted_ids, expert_ends(sorted_ids, num_experts))


class _PermutedRows(torch.autograd.Function):
    """rows[perm] for a permutation `perm` of the rows, its inverse given: the backward is a gather
    by the inverse, where advanced indexing's would be an accumulating index_put that sorts its
    indices (7 ms of a 352 ms expert-parallel step of the 10-block stand-in, docs/BENCHMARKS.md)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows[perm]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inverse[perm[i]] = i."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))


def permute_rows(rows: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """rows[perm], `inverse` the inverse permutation; gathers both ways (no index_copy, whose kernel
    is 3x slower than a gather here, nor index_put)."""
    return _PermutedRows.apply(rows, perm, inverse)


def expert_outputs(experts: GroupedExperts, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
                   run_experts=run_local_experts) -> torch.Tensor:
    """sum_k top_w[t, k] * expert_{top_i[t, k]}(x[t]) for every token t, dropless. `run_experts`
    takes the rows sorted by expert to their experts and back (here, or across the ep ranks)."""
    tokens, k = top_i.shape
    num_experts = experts.num_experts
    # Stable sort: within an expert, rows keep token order, so results do not depend on the sort.
    sorted_ids, order = top_i.reshape(-1).sort(stable=True)
    inverse = inverse_permutation(order)
    pairs = x.unsqueeze(1).expand(tokens, k, x.shape[-1]).reshape(tokens * k, -1)  # (token, slot) order
    out_sorted = run_experts(experts, permute_rows(pairs, order, inverse), sorted_ids, num_experts)
    # Back to (token, slot) order (a permutation: no atomics), then a sum over the k slots.
    out = permute_rows(out_sorted, inverse, order)
    return (out.view(tokens, k, -1) * top_w.unsqueeze(-1)).sum(dim=1)
