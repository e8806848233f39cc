"""Held-out loss: the same token-weighted cross-entropy as training, over the whole eval split,
at the steps a run evaluates (each logged once)."""

from __future__ import annotations

import math

import torch

from sft.data.batches import MicroBatches
from sft.data.masking import IGNORE_INDEX
from sft.distributed import DistEnv, all_reduce_sum, decided_on_rank0, log0
from sft.parallel.mesh import ParallelDims
from sft.training.loss import image_inputs, loss_inputs, on_device
from sft.training.metrics import MetricsLogger, StepMetrics
from sft.training.model import TrainingModel


class Evaluations:
    """A run's held-out evaluations: before training (step 0), every eval.every_steps, and after the
    last step, each in metrics.jsonl exactly once whatever stops, kills and relaunches come between.
    A run that resumes at a step whose evaluation metrics.jsonl lacks (a stop was decided at that
    step, or a kill came between its checkpoint and its evaluation) evaluates it first; one already
    logged (a relaunch after a kill during the export) is not run again."""

    def __init__(self, built: TrainingModel, batches: MicroBatches | None, micro_batch_size: int, every_steps: int,
                 total_steps: int, env: DistEnv, dims: ParallelDims, metrics: StepMetrics, logger: MetricsLogger,
                 first: float | None = None):
        """`first`: the eval loss of the run's start, as a resumed run's checkpoint recorded it."""
        self.built, self.batches, self.micro_batch_size = built, batches, micro_batch_size
        self.env, self.dims = env, dims
        self.every_steps, self.total_steps, self.metrics, self.logger = every_steps, total_steps, metrics, logger
        self.losses: dict[int, float] = decided_on_rank0(lambda: dict(logger.evaluations))  # step -> eval loss
        self.first = first

    def begin(self, start_step: int) -> None:
        """Before the first step: step 0's eval, or that of the step the run resumes at if it was
        never logged (a stop or a kill came first)."""
        loss = self.at(start_step)
        self.first = self.first if self.first is not None else loss

    def end(self) -> None:
        """After the last step: its eval, and how far the loss came."""
        last = self.at(self.total_steps)
        if last is not None and self.first is not None:
            log0(f"eval loss {self.first:.4f} -> {last:.4f} ({1 - last / self.first:.0%} lower)")

    def due(self, step: int) -> bool:
        """Whether the run evaluates after `step` (0: before training)."""
        return self.batches is not None and (step in (0, self.total_steps) or
                                             bool(self.every_steps) and step % self.every_steps == 0)

    def at(self, step: int) -> float | None:
        """The eval loss after `step` if the run evaluates there (computed and logged once), else None."""
        if not self.due(step):
            return None
        if step not in self.losses:
            self.metrics.pause()  # the next step's time starts after the eval
            self.losses[step] = evaluate(self.built, self.batches, self.micro_batch_size, self.env, self.dims)
            self.logger.log({"step": step, "eval_loss": self.losses[step]})
        return self.losses[step]


@torch.no_grad()
def evaluate(built: TrainingModel, batches: MicroBatches, micro_batch_size: int, env: DistEnv,
             dims: ParallelDims) -> float:
    """Mean CE per supervised token over the eval set, samples spread round-robin over the
    data-parallel ranks (each row split over its cp group's ranks).

    Every rank runs the same number of forward passes (FSDP's collectives need it); a rank that
    runs out of samples feeds a batch whose labels are all ignored, which adds nothing.
    """
    model = built.model
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
        ce_sum += built.loss(**on_device(inputs, env.device), images=image_inputs(built, batch)).double()
    model.train()
    total_ce, total_tokens = all_reduce_sum([ce_sum.item(), tokens], env.device).tolist()
    return total_ce / total_tokens
