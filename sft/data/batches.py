"""Each optimizer step's micro-batches: which samples (a pure function of the step), packed or
padded, collated into the tensors the model and the loss take."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import datasets
import torch

from sft.config import ConfigError, DataConfig
from sft.data.collate import collate, collate_packed
from sft.data.images import rows_with_images


def pack_best_fit(lengths: list[int], row_len: int) -> list[list[int]]:
    """Group sample indices into rows of at most `row_len` tokens, best-fit decreasing: longest
    first, each into the open row with the least room that still fits it."""
    rows: list[list[int]] = []
    by_room: list[list[int]] = [[] for _ in range(row_len + 1)]  # room left -> rows with that room
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[index]
        room = next((r for r in range(n, row_len + 1) if by_room[r]), None)
        if room is None:
            rows.append([])
            row, room = len(rows) - 1, row_len
        else:
            row = by_room[room].pop()
        rows[row].append(index)
        by_room[room - n].append(row)
    return rows


@functools.lru_cache(maxsize=2)
def _epoch_order(num_samples: int, seed: int) -> torch.Tensor:
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class StepSampler:
    """Which samples each data-parallel rank trains on at each optimizer step: a pure function of the step.

    Each epoch is a seeded permutation of the training set cut into global batches (the incomplete
    tail is dropped; sft/parallel/mesh.py:ParallelDims.global_batch says how large); data-parallel
    rank r takes its contiguous share of micro_batch_size x grad_accum_steps samples and splits it
    into grad_accum_steps micro-batches. Because the order depends only on (seed, step, global
    batch), resuming needs only the step number, and a resumed run on another number of ranks with
    the same global batch sees the same samples.
    """

    num_samples: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch: int
    rank: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def micro_batches(self, step: int) -> list[list[int]]:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = _epoch_order(self.num_samples, self.seed + epoch)
        per_rank = self.micro_batch_size * self.grad_accum_steps
        start = k * self.global_batch + self.rank * per_rank
        mine = order[start : start + per_rank].tolist()
        return [mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]


class MicroBatches:
    """Builds collated micro-batches from sampler indices: samples padded per micro-batch, or with
    `packed_rows`, indices of packed rows whose samples are laid end to end."""

    def __init__(self, dataset: datasets.Dataset, pad_token_id: int, cfg: DataConfig,
                 packed_rows: list[list[int]] | None = None):
        self.dataset, self.pad_token_id, self.cfg, self.packed_rows = dataset, pad_token_id, cfg, packed_rows

    def _samples(self, indices: list[int]) -> list[dict]:
        rows = self.dataset[indices]
        images = rows.get("images") or [[] for _ in indices]
        return [{"input_ids": i, "labels": lab, "images": im}
                for i, lab, im in zip(rows["input_ids"], rows["labels"], images)]

    def __call__(self, indices: list[int]) -> tuple[dict, int]:
        """The micro-batch and its number of real (non-pad) tokens. A micro-batch with images also
        holds their sources (`images`), in the order their placeholders appear in its rows."""
        if self.packed_rows is None:
            samples = self._samples(indices)
            batch = collate(samples, self.pad_token_id, self.cfg.max_seq_len, self.cfg.pad_to_multiple_of,
                            pad_to_max=self.cfg.pad_to == "max_seq_len")
        else:
            groups = [self.packed_rows[i] for i in indices]
            samples = self._samples([i for group in groups for i in group])  # row after row, as they are laid
            laid = iter(samples)
            rows = [[next(laid) for _ in group] for group in groups]
            batch = collate_packed(rows, self.pad_token_id, self.cfg.max_seq_len)
        if images := [source for s in samples for source in s["images"]]:
            batch["images"] = images
        return batch, sum(len(s["input_ids"]) for s in samples)


class TrainBatches:
    """This rank's micro-batches for each optimizer step. With data.packing the sampler draws
    packed rows (best-fit decreasing over the training set) instead of single samples."""

    def __init__(self, dataset: datasets.Dataset, pad_token_id: int, cfg: DataConfig, micro_batch_size: int,
                 grad_accum_steps: int, global_batch: int, rank: int, seed: int):
        self.rows_with_images = rows_with_images(dataset)
        self.packed_rows = pack_best_fit(dataset["length"], cfg.max_seq_len) if cfg.packing else None
        self.sampler = StepSampler(len(self.packed_rows) if self.packed_rows else len(dataset), micro_batch_size,
                                   grad_accum_steps, global_batch, rank, seed)
        if self.sampler.steps_per_epoch == 0:
            raise ConfigError(f"{self.sampler.num_samples} training {'rows' if self.packed_rows else 'samples'} < "
                              f"one global batch of {self.sampler.global_batch}; lower train.micro_batch_size or "
                              "train.grad_accum_steps")
        self.batches = MicroBatches(dataset, pad_token_id, cfg, self.packed_rows)
        self.num_samples = len(dataset)

    def step(self, step: int) -> list[tuple[dict[str, torch.Tensor], int]]:
        """(micro-batch, real tokens) pairs of optimizer step `step` (1-based)."""
        return [self.batches(indices) for indices in self.sampler.micro_batches(step - 1)]

    def describe(self) -> str:
        packed = f", packed into {len(self.packed_rows)} rows" if self.packed_rows else ""
        images = f" ({self.rows_with_images} with images)" if self.rows_with_images else ""
        return f"{self.num_samples} train samples{images}{packed}, global batch {self.sampler.global_batch}"
