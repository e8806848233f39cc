"""Turn tokenised samples into the tensors the model and the loss take.

Right padding needs no attention mask for a causal model: a real token only attends to earlier
positions, never to the pads after it, and pads carry IGNORE_INDEX labels. Leaving the mask out
keeps SDPA on its fused causal kernel. `position_ids` are always returned, so a packing collate
(several documents per row, positions restarting per document) fits the same interface.
"""

from __future__ import annotations

import torch

from sft.masking import IGNORE_INDEX


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
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
