"""Assistant-only labels: which tokens of a rendered conversation are trained, and how they are cut.

Every assistant turn is supervised, including its end-of-turn token (or the model never learns to
stop); system/user/tool content, role headers and any system prompt the template injects get
IGNORE_INDEX.

Tokenisation follows inference. The model's chat template renders the conversation to text, the
text is cut at the rendered turn boundaries into prompt segments (everything up to and including
the generation prompt, e.g. "<|im_start|>assistant\\n") and assistant segments (the turn's text or
tool-call text and its end-of-turn token), and each segment is tokenised on its own. Tokenising the
whole string instead lets a byte-level BPE merge across a boundary: with Qwen2's vocabulary
"assistant\\n" + "\\nThe" becomes `assistant`, `ĊĊ`, `The`, a token that is half prompt, half reply,
which the model never sees at inference (the prompt ends with `Ċ`, then it generates). Whitespace
the template writes after the end-of-turn token (ChatML's "\\n") belongs to the next prompt segment
and is not supervised.

The trade-off: in a multi-turn row, earlier turns are tokenised as the model generated them (each
on its own), whereas at inference a chat server re-tokenises the whole history as one string. The
two differ only where a merge would cross a turn boundary, and then the training row holds the
generated form.

Assistant text is found in the rendering in one of two ways:
* the template marks it with `{% generation %}`: the marked character spans;
* otherwise (stock Qwen2.5 / Llama-3 templates): the conversation is rendered up to just before
  each assistant turn (with the generation prompt) and through it, and the text in between is
  that turn. This needs the template to be prefix-preserving *as text*, which is checked for every
  turn; a conversation where it fails (Qwen3's template, which rewrites earlier `<think>` blocks)
  is dropped and counted, never trained with a wrong mask.
"""

from __future__ import annotations

import re
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
NOT_PREFIX_PRESERVING = (
    "chat template is not prefix-preserving as text at an assistant turn (it rewrites earlier turns, "
    "like Qwen3's <think> handling): to train such rows, wrap the assistant text and end-of-turn token "
    "of the tokenizer's chat template in {% generation %} ... {% endgeneration %} (README: How masking works)")

Segment = tuple[str, bool]
"""A piece of the rendered conversation and whether it is supervised (an assistant turn)."""


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


def _render(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]], tools: list | None,
            add_generation_prompt: bool = False, generation_spans: bool = False) -> tuple[list[str], list]:
    """Texts (and {% generation %} character spans) of several conversations in one call.

    The same renderer as `apply_chat_template` (which cannot return the spans without tokenising):
    the tokenizer's special tokens as template variables, messages without their None-valued keys.
    """
    conversations = [[{k: v for k, v in m.items() if v is not None} for m in c] for c in conversations]
    try:
        return render_jinja_template(conversations, tools=tools, chat_template=tokenizer.get_chat_template(None, tools),
                                     add_generation_prompt=add_generation_prompt,
                                     return_assistant_tokens_mask=generation_spans, **tokenizer.special_tokens_map)
    except jinja2.TemplateError as e:  # e.g. raise_exception('Conversation roles must alternate ...')
        raise DropSample(f"the chat template refused the conversation: {e}") from None


def _assistant_spans(tokenizer, messages, tools) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it."""
    if has_generation_tags(tokenizer):
        (text,), (marked,) = _render(tokenizer, [messages], tools, generation_spans=True)
        spans: list[list[int]] = []
        for start, end in sorted(marked):  # one turn marked in several touching blocks is one segment
            if spans and start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([start, end])
        return text, spans
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompts, _ = _render(tokenizer, [messages[:i] for i in turns], tools, add_generation_prompt=True)
    full = [messages] if turns[-1] != len(messages) - 1 else []
    throughs, _ = _render(tokenizer, [messages[: i + 1] for i in turns] + full, tools)
    text = throughs[-1]
    spans, end = [], 0
    for prompt, through in zip(prompts, throughs):
        if not (end <= len(prompt) and through.startswith(prompt) and text.startswith(through)):
            raise DropSample(NOT_PREFIX_PRESERVING)
        spans.append((len(prompt), len(through)))
        end = len(through)
    return text, spans


def render_segments(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list | None) -> list[Segment]:
    """The conversation rendered by its chat template, cut into prompt and assistant segments.

    An assistant segment ends at its last non-whitespace character: whitespace the template writes
    after the end-of-turn token goes to the next prompt segment. Raises DropSample.
    """
    validate_messages(messages)
    text, spans = _assistant_spans(tokenizer, messages, tools)
    segments: list[Segment] = []
    pos = 0
    for start, end in spans:
        end = start + len(text[start:end].rstrip())
        if end == start:
            continue
        if start > pos:
            segments.append((text[pos:start], False))
        segments.append((text[start:end], True))
        pos = end
    if pos < len(text):
        segments.append((text[pos:], False))
    if not any(supervised for _, supervised in segments):
        raise DropSample("the chat template marked no assistant text")
    if len(segments) == 1:
        raise DropSample("the chat template marked every token as assistant")
    return segments


def encode_segments(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Segment]],
                    last_turn_only: bool = False) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each conversation: its segments tokenised one by one, in one batched call."""
    texts = [text for segments in conversations for text, _ in segments]
    if not texts:
        return []
    encoded = iter(tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"])
    out = []
    for segments in conversations:
        last = max(i for i, (_, supervised) in enumerate(segments) if supervised)
        ids, labels = [], []
        for i, (_, supervised) in enumerate(segments):
            piece = next(encoded)
            ids += piece
            labels += piece if supervised and (i == last or not last_turn_only) else [IGNORE_INDEX] * len(piece)
        out.append((ids, labels))
    return out


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list | None,
                          max_seq_len: int, last_turn_only: bool = False) -> tuple[list[int], list[int]]:
    """Return (input_ids, labels) with labels = input_ids on supervised tokens, IGNORE_INDEX elsewhere.

    Labels follow the Hugging Face convention (not shifted: the loss shifts). Raises DropSample.
    """
    (ids, labels), = encode_segments(tokenizer, [render_segments(tokenizer, messages, tools)], last_turn_only)
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
