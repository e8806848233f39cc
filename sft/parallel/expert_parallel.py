"""Expert parallelism (moe.ep_degree): each rank of an ep group holds E/ep whole experts of every MoE
block, and the rows routed to an expert travel to the rank that holds it and back.

Placement (`apply_expert_parallel`, on the meta-device model before anything wraps the blocks):
each block's expert weights become DTensors over the ep ranks, sharded by expert (Shard(0): ep rank
r holds experts [r E/ep, (r+1) E/ep)); FSDP then shards them over the ranks orthogonal to ep, or
leaves them whole where ep spans every rank (sft/parallel/fsdp.py). Everything else stays
FSDP-sharded over all ranks. Checkpoints hold the global tensors: a run resumes at any ep degree.

Dispatch (`run_experts_across_ranks`, per block, the rows sorted by expert, sft/models/experts.py):

1. the rows per expert (from the sorted ids' group ends) go to every ep rank in one all-to-all of E
   integers, so each rank learns how many rows it will receive from whom;
2. **one host sync per block forward**: all_to_all needs its split sizes as host integers, and
   they depend on this step's routing. (Backward reuses them; a checkpointed block's recomputation
   and its op's backward, which reuse the forward's routing, send the rows again: a sync each.)
3. the rows go to their experts' ranks in one all-to-all (exactly the routed rows: no capacity,
   no padding, nothing dropped; a rank whose experts got no row sends and receives empty splits
   and still takes part), are regrouped by local expert (a stable sort: rows keep their source
   order), run through the local experts' grouped GEMMs, put back in arrival order and return in
   the reverse all-to-all (`_AllToAll`: backward sends the gradients the other way).

The all-to-alls are c10d's own calls (the functional collectives' wrappers cost host time where
the GPU waits for the host). Activation checkpointing recomputes them with the block (keeping what
arrived would cost a block's whole MoE activations). Without checkpointing the dispatch runs
eagerly, a graph break the compiled block compiles around; a checkpointed compiled block with a
break ran eagerly whole (half ep 1's speed, the whole Qwen3-30B-A3B), so in a checkpointed block
the experts are one opaque op (`_expert_outputs_op`), whose backward runs their forward again.
Measured and dropped (docs/BENCHMARKS.md, issue #62): two chunks of rows, one's transfer under the
other's matmuls (3.5% slower); NVSHMEM's device-sized all-to-all (no sync; 10x slower than NCCL's).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import SAC_IGNORED_OPS

from sft.distributed import log0
from sft.models.experts import GroupedExperts, expert_ends, expert_outputs, inverse_permutation, permute_rows

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from sft.models.moe import MoE
    from sft.parallel.mesh import ParallelDims


class _AllToAll(torch.autograd.Function):
    """Rows to the ep ranks: `in_splits[r]` of them to rank r, `out_splits[r]` from it; backward
    sends their gradients the other way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, *ctx.splits, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group)
    return out


def _through_local_experts(experts: GroupedExperts, arrived: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Arrived rows (source-major, then by local expert; `counts` [ranks, local]: how many of
    each) through this rank's experts, outputs in arrival order."""
    local = counts.shape[1]
    local_ids = torch.arange(local, device=arrived.device).repeat(counts.shape[0]).repeat_interleave(
        counts.reshape(-1), output_size=arrived.shape[0])
    # Regroup by local expert; stable, so each expert's rows keep their source (and token) order.
    local_sorted, regroup = local_ids.sort(stable=True)
    arrival = inverse_permutation(regroup)
    out = experts.compute(permute_rows(arrived, regroup, arrival), local_sorted, expert_ends(local_sorted, local))
    return permute_rows(out, arrival, regroup)


@torch.compiler.disable  # split sizes are data-dependent host integers (a graph break; in the op, eager)
def run_experts_across_ranks(experts: GroupedExperts, rows: torch.Tensor, sorted_ids: torch.Tensor,
                             num_experts: int) -> torch.Tensor:
    """Rows sorted by (global) expert through their experts, wherever they live on the ep ranks
    (`experts.ep_group`); returns their outputs in the same order."""
    group = experts.ep_group
    ranks = group.size()
    local = num_experts // ranks
    # [ranks, local]: rows for each expert, from here; from the sorted ids' group ends (bincount syncs on CUDA)
    sent_counts = torch.diff(expert_ends(sorted_ids, num_experts).long(),
                             prepend=sorted_ids.new_zeros(1)).view(ranks, local)
    received_counts = torch.empty_like(sent_counts)  # [ranks, local]: rows each rank sends to this rank's experts
    dist.all_to_all_single(received_counts, sent_counts, group=group)
    sent, received = torch.stack([sent_counts.sum(1), received_counts.sum(1)]).tolist()  # the host sync
    arrived = _AllToAll.apply(rows, received, sent, group)  # source-major, then expert
    return _AllToAll.apply(_through_local_experts(experts, arrived, received_counts), sent, received, group)


def expert_outputs_across_ranks(experts: GroupedExperts, x: torch.Tensor, top_w: torch.Tensor,
                                top_i: torch.Tensor) -> torch.Tensor:
    """GroupedExperts.outputs under expert parallelism, in a block that is not checkpointed: eagerly
    (a graph break, which the compiled block compiles around)."""
    return expert_outputs(experts, x, top_w, top_i, run_experts_across_ranks)


# The experts of each checkpointed block, for the op below (which takes tensors only): key -> experts.
_ACROSS_RANKS: dict[int, weakref.ref] = {}


def _outputs_across_ranks(key: torch.Tensor, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor):
    return expert_outputs_across_ranks(_ACROSS_RANKS[int(key)](), x, top_w, top_i)


@torch.library.custom_op("sft::expert_outputs_across_ranks", mutates_args=())
def _expert_outputs_op(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """One block's experts across the ep ranks as one op whose output has the input's shape: a
    compiled checkpointed block holds it whole, where the dispatch's graph break sent the whole
    block to eager (half the speed). The experts' weights are read from the module, as its forward
    would (FSDP's gathered ones, or each rank's own), not passed in (a DTensor's to_local in a
    compiled checkpointed region fails); `key` (a tensor: an integer would be a constant, one
    compiled graph per block) names the experts."""
    with torch.no_grad():
        return _outputs_across_ranks(key, x, top_w, top_i)


@_expert_outputs_op.register_fake
def _(x, top_w, top_i, key):
    return torch.empty_like(x)


def _autograd_back_on():
    """A context in which autograd records again: a custom op's kernel runs below autograd's
    dispatch keys (torch._library.autograd), and its backward differentiates the experts' forward."""
    keys = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "AutogradCPU", "AutogradCUDA"):
        if hasattr(torch._C.DispatchKey, name):
            keys = keys.remove(getattr(torch._C.DispatchKey, name))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys)


@torch.library.custom_op("sft::expert_outputs_across_ranks_backward", mutates_args=())
def _expert_outputs_backward_op(grad: torch.Tensor, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
                                key: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of x and top_w: the experts' forward once more with autograd (the rows sent
    again and one more host sync; under checkpointing this comes on top of the recomputation's),
    then its backward, which also accumulates the experts' weight gradients where autograd puts a
    leaf's (so FSDP reduces them after this block's backward)."""
    with _autograd_back_on(), torch.enable_grad():
        x, top_w = x.detach().requires_grad_(), top_w.detach().requires_grad_()
        torch.autograd.backward(_outputs_across_ranks(key, x, top_w, top_i), grad)
    return [x.grad, top_w.grad]


@_expert_outputs_backward_op.register_fake
def _(grad, x, top_w, top_i, key):
    return [torch.empty_like(x), torch.empty_like(top_w)]


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    grad_x, grad_w = _expert_outputs_backward_op(grad, *ctx.saved_tensors)
    return grad_x, grad_w, None, None


_expert_outputs_op.register_autograd(_backward, setup_context=_save_inputs)


def expert_outputs_as_one_op(experts: GroupedExperts, x: torch.Tensor, top_w: torch.Tensor,
                             top_i: torch.Tensor) -> torch.Tensor:
    """GroupedExperts.outputs under expert parallelism in a checkpointed block: the op. It carries
    gradients through its inputs alone, so where none needs one but the experts train (LoRA on the
    experts alone, the first block), eagerly instead."""
    if torch.is_grad_enabled() and not (x.requires_grad or top_w.requires_grad) and \
            any(p.requires_grad for p in experts.parameters()):
        return expert_outputs_across_ranks(experts, x, top_w, top_i)
    return _expert_outputs_op(x, top_w, top_i, experts.ep_key)


def _shard_by_expert(experts: nn.Module, mesh) -> None:
    """Each expert weight (and gpt-oss bias, and LoRA's adapters of them) of `experts` as a DTensor
    over the ep ranks, sharded by expert; on the meta device, where nothing is allocated."""
    for name, param in list(experts.named_parameters()):
        ranks, rank = mesh.size(), mesh.get_local_rank()
        local = param.detach().chunk(ranks)[rank]
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape,
                                     stride=param.stride())
        owner, _, attr = name.rpartition(".")
        experts.get_submodule(owner).register_parameter(attr, nn.Parameter(sharded, requires_grad=param.requires_grad))


def apply_expert_parallel(moe: MoE, dims: ParallelDims, checkpointed: set[nn.Module]) -> None:
    """Spread every MoE block's experts over the ep ranks and send each block's rows across them:
    in a block of `checkpointed` (modules of the blocks activation checkpointing wraps) as one op
    (its backward runs the experts' forward once more), elsewhere eagerly. The same function on
    every block, the group and key on the experts: compiled blocks share one graph."""
    mesh = dims.ep_mesh
    # Where each block's experts are an FSDP unit inside the (checkpointed) block, its hooks mark
    # themselves for the profiler a different number of times in forward and in recomputation;
    # selective checkpointing matches every op of the two by count. The marks compute nothing.
    SAC_IGNORED_OPS.update((torch.ops.profiler._record_function_enter_new.default,
                            torch.ops.profiler._record_function_exit._RecordFunction))
    for block in moe.blocks:
        experts = block.experts
        _shard_by_expert(experts, mesh)
        experts.ep_group = mesh.get_group()
        if block in checkpointed:
            experts.ep_key = torch.tensor(len(_ACROSS_RANKS))
            _ACROSS_RANKS[len(_ACROSS_RANKS)] = weakref.ref(experts)
        experts.outputs = expert_outputs_as_one_op if block in checkpointed else expert_outputs_across_ranks
    log0(f"applied expert parallelism: {moe.num_experts // dims.ep} of {moe.num_experts} "
         f"experts per rank in {len(moe.blocks)} blocks, over {dims.ep} ranks")
