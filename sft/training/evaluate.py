"""Held-out loss: the same token-weighted cross-entropy as training, over the whole eval split."""

from __future__ import annotations

import math
import torch
from torch import nn

from sft.parallel.mesh import ParallelDims
from sft.data.batches import MicroBatches
from sft.distributed import DistEnv, all_reduce_sum, to_device
from sft.training.loss import loss_inputs
from sft.data.masking import IGNORE_INDEX


@torch.no_grad()
def evaluate(model: nn.Module, batches: MicroBatches, micro_batch_size: int, env: DistEnv,
             dims: ParallelDims) -> float:
    """Mean CE per supervised token over the eval set, samples spread round-robin over the
    data-parallel ranks (each row split over its cp group's ranks).

    Every rank runs the same number of forward passes (FSDP's collectives need it); a rank that
    runs out of samples feeds a batch whose labels are all ignored, which adds nothing.
    """
    model.train(False)  # inference mode (dropout off), restored below
    size = len(batches.dataset)
    mine = list(range(dims.dp_rank, size, dims.dp_size))
    num_batches = math.ceil(math.ceil(size / dims.dp_size) / micro_batch_size)
    ce_sum, tokens = torch.zeros((), dtype=torch.float64, device=env.device), 0
    for b in range(num_batches):
        indices = mine[b * micro_batch_size : (b + 1) * micro_batch_size]
        batch, _ = batches(indices or [0])
        if not indices:
            batch["labels"].fill_(IGNORE_INDEX)
        inputs = loss_inputs(batch, dims)
        tokens += len(inputs["target_ids"])
        ce_sum += model.sft_loss(**{k: to_device(v, env.device) for k, v in inputs.items()}).double()
    model.train()
    total_ce, total_tokens = all_reduce_sum([ce_sum.item(), tokens], env.device).tolist()
    return total_ce / total_tokens
