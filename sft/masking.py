"""Assistant-only labels: which tokens of a rendered conversation are trained.

Every assistant turn is supervised, including its end-of-turn token (or the model never learns to
stop); system/user/tool content, role headers and any system prompt the template injects get
IGNORE_INDEX. Two ways to find the assistant tokens, both through the model's own chat template:

* the template marks them with `{% generation %}`: transformers returns the mask directly;
* otherwise (stock Qwen2.5 / Llama-3 templates): render the conversation up to just before each
  assistant turn (with the generation prompt) and up to its end; the tokens in between are that
  turn. This needs the template to be prefix-preserving, which is asserted for every turn; a
  conversation where it fails is dropped and counted, never trained with a wrong mask. Whitespace
  the template appends after the end-of-turn token (ChatML's "\n") is not supervised.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class DropSample(Exception):
    """This conversation cannot be trained; the message is the reason, counted in the log."""


def has_generation_tags(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def validate_messages(messages: Any) -> None:
    """Raise DropSample unless `messages` is a list of {role, content} with known roles."""
    if not isinstance(messages, list) or not messages:
        raise DropSample("empty or not a list of messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise DropSample("a message is not a {role, content} mapping")
        if m["role"] not in ROLES:
            raise DropSample(f"unknown role {m['role']!r} (known: {', '.join(ROLES)})")
        content = m.get("content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise DropSample(f"{m['role']} message without content")
        if content is not None and not isinstance(content, str):
            raise DropSample(f"{m['role']} content is {type(content).__name__}, expected a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise DropSample("no assistant turn")


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list | None,
            add_generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"])


def _spans_from_generation_mask(tokenizer, messages, tools) -> tuple[list[int], list[tuple[int, int]]]:
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    spans, start = [], None
    for i, bit in enumerate(mask + [0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return ids, spans


def _spans_from_prefixes(tokenizer, messages, tools) -> tuple[list[int], list[tuple[int, int]]]:
    ids = _render(tokenizer, messages, tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], tools)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise DropSample("chat template is not prefix-preserving at an assistant turn "
                             "(use a template with {% generation %} for this model)")
        end = len(through)
        while end > len(before) and not tokenizer.decode(ids[end - 1 : end]).strip():
            end -= 1  # trailing newline after the end-of-turn token
        spans.append((len(before), end))
    return ids, spans


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list | None,
                          max_seq_len: int, last_turn_only: bool = False) -> tuple[list[int], list[int]]:
    """Return (input_ids, labels) with labels = input_ids on supervised tokens, IGNORE_INDEX elsewhere.

    Labels follow the Hugging Face convention (not shifted: the loss shifts). Raises DropSample.
    """
    validate_messages(messages)
    if has_generation_tags(tokenizer):
        ids, spans = _spans_from_generation_mask(tokenizer, messages, tools)
    else:
        ids, spans = _spans_from_prefixes(tokenizer, messages, tools)
    if not spans:
        raise DropSample("the chat template marked no assistant tokens")
    if len(spans) == 1 and spans[0] == (0, len(ids)):
        raise DropSample("the chat template marked every token as assistant")
    if last_turn_only:
        spans = spans[-1:]
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        labels[start:end] = ids[start:end]
    return truncate_tokenized(ids, labels, max_seq_len)


def truncate_tokenized(ids: list[int], labels: list[int], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Truncate to max_seq_len; raise DropSample if no supervised token is left."""
    if len(ids) != len(labels) or not ids:
        raise DropSample("input_ids and labels are empty or of different lengths")
    ids, labels = list(ids[:max_seq_len]), list(labels[:max_seq_len])
    # The first token is never a target (nothing precedes it); this also keeps a packed row from
    # training the end of one document to predict the start of the next.
    labels[0] = IGNORE_INDEX
    if all(label == IGNORE_INDEX for label in labels):
        raise DropSample("no supervised tokens left after truncation to data.max_seq_len")
    return ids, labels
