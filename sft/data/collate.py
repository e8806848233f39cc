"""Turn tokenised samples into the tensors the model and the loss take.

Right padding needs no attention mask for a causal model: a real token only attends to earlier
positions, never to the pads after it, and pads carry IGNORE_INDEX labels. Leaving the mask out
keeps SDPA on its fused causal kernel. `position_ids` are always returned, so a packing collate
(several documents per row, positions restarting per document) fits the same interface.
`real_tokens` marks what is not padding (the pad id may also be a real token, e.g. EOS): the
load-balancing loss of MoE models counts real tokens only (sft/models/moe.py).
"""

from __future__ import annotations

import torch

from sft.data.masking import IGNORE_INDEX


def padded_length(longest: int, pad_to_multiple_of: int, max_seq_len: int, pad_to_max: bool) -> int:
    if pad_to_max:
        return max_seq_len
    return min(-(-longest // pad_to_multiple_of) * pad_to_multiple_of, max_seq_len)


def collate(samples: list[dict], pad_token_id: int, max_seq_len: int, pad_to_multiple_of: int = 1,
            pad_to_max: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch of {input_ids, labels} (labels unshifted, Hugging Face convention)."""
    length = padded_length(max(len(s["input_ids"]) for s in samples), pad_to_multiple_of, max_seq_len, pad_to_max)
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.as_tensor(sample["input_ids"])
        labels[row, :n] = torch.as_tensor(sample["labels"])
    position_ids = torch.arange(length).expand(len(samples), length).contiguous()
    real_tokens = torch.arange(length) < torch.tensor([len(s["input_ids"]) for s in samples])[:, None]
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "real_tokens": real_tokens}


def collate_packed(rows: list[list[dict]], pad_token_id: int, row_len: int) -> dict[str, torch.Tensor]:
    """Each row is several samples laid end to end, right-padded to `row_len`.

    Positions restart at 0 for every sample, which is how transformers' attention (sdpa and
    flex_attention with use_cache=False) knows where one document ends: no token attends across
    a boundary. Every sample's first label is already IGNORE_INDEX, so the last token of one
    sample is never trained to predict the first of the next.
    """
    input_ids = torch.full((len(rows), row_len), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), row_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), row_len), dtype=torch.long)
    real_tokens = torch.zeros((len(rows), row_len), dtype=torch.bool)
    for r, samples in enumerate(rows):
        start = 0
        for sample in samples:
            n = len(sample["input_ids"])
            input_ids[r, start : start + n] = torch.as_tensor(sample["input_ids"])
            labels[r, start : start + n] = torch.as_tensor(sample["labels"])
            position_ids[r, start : start + n] = torch.arange(n)
            start += n
        real_tokens[r, :start] = True
        # The padding continues the last sample's positions, so it reads as part of it (and is
        # ignored by the loss) rather than as a new document.
        position_ids[r, start:] = torch.arange(row_len - start) + (position_ids[r, start - 1] + 1 if start else 0)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "real_tokens": real_tokens}
