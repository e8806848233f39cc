"""A conversation -> its training rows: the three chat formats normalised to messages, rendered
and cut by the chat template (masking.py), tokenised with labels, each image's placeholder expanded
to its tokens (images.py). `prepare` runs it over a split with `datasets.map`, whose cache is keyed
on the source of this module, masking.py and images.py: the code that decides the tokens."""

from __future__ import annotations

import json
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from sft.data.images import ImageTokens, image_parts, with_image_column
from sft.data.masking import IGNORE_INDEX, DropSample, RowPlan, encode_segments, render_rows, truncate_tokenized
from sft.data.sources import SOURCE_ROW

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant",
                  "observation": "tool", "function": "tool"}


def _drop_nulls(value: Any) -> Any:
    # Arrow unifies the keys of all rows' structs and fills the missing ones with None;
    # the chat template must see each message as it was written.
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def to_messages(row: dict, fmt: str) -> tuple[list[dict], list | None]:
    """One row -> (OpenAI-style messages, tools). Raises DropSample on malformed rows."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError:
            raise DropSample("the tools column is not valid JSON") from None
    if fmt == "messages":
        messages = row["messages"]
    elif fmt == "conversations":
        messages = []
        for turn in row["conversations"] or []:
            if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
                raise DropSample(f"unknown ShareGPT role {turn.get('from') if isinstance(turn, dict) else turn!r}")
            messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")})
    else:
        prompt, completion = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise DropSample("prompt/completion must be strings or lists of messages")
        messages = prompt + completion
    return _drop_nulls(messages), _drop_nulls(tools) if tools else None


ROW_COLUMNS = (SOURCE_ROW, "part", "parts", "turns", "assistant_turns", "reasoning_turns")
TOKENIZED_FEATURES = datasets.Features({
    **{name: datasets.List(datasets.Value("int64")) for name in ("input_ids", "labels", "turns")},
    "images": datasets.List(datasets.Value("string")),
    **{name: datasets.Value("int64") for name in ("length", "cut", SOURCE_ROW, "part", "parts", "assistant_turns",
                                                  "reasoning_turns")},
    "drop_reason": datasets.Value("string")})
"""Declared, not inferred: a batch whose rows are all dropped has only empty lists, which Arrow
would type as lists of nulls that the next batch's token ids cannot be cast to."""
"""Where a training row comes from: its conversation's file row, its place among that conversation's
rows (part of parts: several when the chat template rewrites history), the assistant turns it trains
(counted from 0), and the conversation's numbers of assistant turns and of turns carrying reasoning."""


def tokenize_batch(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, fmt: str, max_seq_len: int,
                   last_turn_only: bool, template_kwargs: dict, images: ImageTokens | None = None,
                   image_dir: str = ".") -> dict[str, list]:
    """A batch of conversations -> their training rows: input_ids, labels, length, tokens cut by
    truncation, drop_reason ('' = kept), the sources of the row's images and ROW_COLUMNS. A dropped
    conversation is one row with its reason and no tokens. Conversations are rendered one by one,
    then all segments of all their rows are tokenised in one call. `images`: the model's image
    tokens (None: it takes no images); `image_dir`: where relative image paths start."""
    origins: list[tuple] = []  # ROW_COLUMNS of each output row
    contents: list[RowPlan | tuple[list[int], list[int]] | str] = []  # to tokenise, tokenised, or a drop reason
    pictures: list[tuple[list[str], list[int]]] = []  # each row's images: sources and tokens each
    for i, source_row in enumerate(batch[SOURCE_ROW]):
        try:
            if fmt == "tokenized":
                contents.append((batch["input_ids"][i], batch["labels"][i]))
                origins.append((source_row, 0, 1, [], 0, 0))
                pictures.append(([], []))
                continue
            row = {column: values[i] for column, values in batch.items()}
            messages, tools = to_messages(row, fmt)
            sources: list[str] = []
            if images is not None:  # a model that takes none trains on the text, as it always did
                messages, sources = image_parts(with_image_column(messages, row), image_dir, images.token)
            plans, reasoning_turns = render_rows(tokenizer, messages, tools, last_turn_only, template_kwargs,
                                                 images is not None)
            counts = [images.count(source) for source in sources]
        except DropSample as e:
            contents.append(str(e))
            origins.append((source_row, 0, 1, [], 0, 0))
            pictures.append(([], []))
            continue
        assistant_turns = sum(m["role"] == "assistant" for m in messages)
        for part, plan in enumerate(plans):
            shown = sum(text.count(images.token) for text, _ in plan.segments) if images is not None else 0
            contents.append(plan if shown <= len(sources) else
                            f"the conversation's text holds the image placeholder {images.token} itself")
            origins.append((source_row, part, len(plans), list(plan.turns), assistant_turns, reasoning_turns))
            pictures.append((sources[:shown], counts[:shown]))
    encoded = iter(encode_segments(tokenizer, [c.segments for c in contents if isinstance(c, RowPlan)]))
    out: dict[str, list] = {name: [] for name in ("input_ids", "labels", "length", "cut", "drop_reason", "images",
                                                  *ROW_COLUMNS)}
    for origin, content, (sources, counts) in zip(origins, contents, pictures):
        ids, labels, cut, reason = [], [], 0, content if isinstance(content, str) else ""
        if not reason:
            pair = next(encoded) if isinstance(content, RowPlan) else content
            try:
                if sources:
                    pair = expand_images(*pair, images.token_id, counts)
                ids, labels = truncate_tokenized(*pair, max_seq_len)
                cut = len(pair[0]) - len(ids)
                sources = sources[:images_kept(ids, images.token_id, counts)] if sources else sources
            except DropSample as e:
                reason = str(e)
        for name, value in zip(("input_ids", "labels", "length", "cut", "drop_reason", "images", *ROW_COLUMNS),
                               (ids, labels, len(ids), cut, reason, sources if not reason else [], *origin)):
            out[name].append(value)
    return out


def expand_images(ids: list[int], labels: list[int], token_id: int, counts: list[int]) -> tuple[list[int], list[int]]:
    """The row with its k-th image placeholder repeated counts[k] times, as the family's processor
    expands it: one token per vision embedding, never supervised."""
    if ids.count(token_id) != len(counts):
        raise DropSample("the image placeholders of the rendered text are not the conversation's images, one each "
                         "(the text holds the placeholder itself, or the tokenizer splits it)")
    out_ids, out_labels, counts = [], [], iter(counts)
    for token, label in zip(ids, labels):
        n = next(counts) if token == token_id else 1
        out_ids += [token] * n
        out_labels += [IGNORE_INDEX if token == token_id else label] * n
    return out_ids, out_labels


def images_kept(ids: list[int], token_id: int, counts: list[int]) -> int:
    """How many of the row's images `ids` (the row as data.max_seq_len cut it) holds whole; DropSample
    where the cut falls inside an image."""
    held, total = ids.count(token_id), 0
    for k, count in enumerate(counts):
        if total == held:
            return k
        total += count
    if total != held:
        raise DropSample("data.max_seq_len cuts through an image: raise data.max_seq_len, or lower the image "
                         "processor's max_pixels (its preprocessor_config.json)")
    return len(counts)
