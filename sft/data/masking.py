"""Assistant-only labels: which tokens of a rendered conversation are trained, in which rows, and how they are cut.

Every assistant turn is supervised once, including its end-of-turn token (or the model never learns to
stop); system/user/tool content, role headers and any system prompt the template injects get
IGNORE_INDEX.

The rule: train every assistant turn as it is generated at inference. For assistant turn k the model
sees render(messages[:k], add_generation_prompt=True) and generates the rest of render(messages[:k+1])
through its end-of-turn token.

Rows (one per conversation where the template is prefix-preserving as text; one per group of turns
that can share a row where it rewrites history, as Qwen3's drops earlier `<think>` blocks), the
tokenisation by segments (prompt segments and supervised ones, each tokenised on its own, so no BPE
merge crosses a turn boundary) and the reasoning fields are explained, with their trade-offs, in
docs/data.md "How masking works".

Where a turn is in the rendering:
* the template marks it with `{% generation %}`: the marked character spans, one row (the template's
  author decides what is trained);
* otherwise: the text between render(messages[:k], add_generation_prompt=True) and
  render(messages[:k+1]). A turn whose rendering does not begin with its own generation prompt has no
  defined generated text; its conversation is dropped and counted, never trained with a wrong mask
  (with `last_turn_only`, only the final turn must have one).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# A template reads a message field as `message.reasoning_content`, `message['thinking']`,
# `'reasoning' in message`; `enable_thinking` and `reasoning_effort` are not fields (the \b and _ rule).
_TEMPLATE_FIELD = re.compile(r"(?:\.|['\"])(reasoning_content|reasoning|thinking)\b(?!_)")
# Qwen3's own template splits inline reasoning off `content` the same way.
_INLINE_REASONING = re.compile(r"\A\s*<think>(.*?)</think>", re.S)
GENERATION_PROMPT_MISMATCH = (
    "the chat template renders an assistant turn not as a continuation of its generation prompt "
    "(add_generation_prompt=True), so what the model generates there is undefined (e.g. reasoning in the data "
    "with enable_thinking: false in data.chat_template_kwargs): fix the data or the template (docs/data.md: How "
    "masking works)")

NOTHING_MARKED = "the chat template marked no assistant text"

Segment = tuple[str, bool]
"""A piece of a row's text and whether it is supervised (an assistant turn)."""


@dataclass(frozen=True)
class RowPlan:
    """One training row before tokenisation."""

    segments: list[Segment]
    turns: tuple[int, ...]
    """The conversation's assistant turns (counted from 0) supervised in this row."""


class DropSample(Exception):
    """This conversation cannot be trained; the message is the reason, counted in the log."""


def has_generation_tags(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def reasoning_field(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The message field the chat template reads reasoning from, or None (inline <think> in content)."""
    template = tokenizer.chat_template
    return _field_read_by(template) if isinstance(template, str) else None


@functools.lru_cache(maxsize=8)  # asked once per conversation; the template is kilobytes of text
def _field_read_by(template: str) -> str | None:
    read = set(_TEMPLATE_FIELD.findall(template))
    return next((field for field in REASONING_FIELDS if field in read), None)


def joined_content_parts(messages: list, images: bool = False) -> list:
    """The messages with OpenAI content parts (`[{"type": "text", "text": ...}, ...]`, the format of
    multimodal-era datasets) as the text a string-content chat template renders: the text parts
    joined by newlines, as vLLM joins them for such templates at inference. With `images` (a model
    that takes them; sft/data/images.py has made each image part `{"type": "image"}`), a message
    holding an image keeps its parts, which the vision-language chat template renders, placeholder
    and text in order. Otherwise a part of another type (an image, audio) drops the sample; so does a
    part that is not a text part as written (no type, no text or text that is not a string) and an
    empty list: guessing would train an empty or wrong turn."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not content:
                raise DropSample(f"{m.get('role')} content is an empty list of content parts")
            if images and IMAGE_PART in content:
                m = {**m, "content": [part if part == IMAGE_PART else
                                      {"type": "text", "text": _part_text(m["role"], part)} for part in content]}
            else:
                m = {**m, "content": "\n".join(_part_text(m.get("role"), part) for part in content)}
        out.append(m)
    return out


IMAGE_PART = {"type": "image"}
"""An image part as the chat template sees it (its source is kept aside: sft/data/images.py)."""
IMAGE_PARTS = ("image", "image_url")  # the OpenAI content parts of a picture


def _part_text(role: str, part: Any) -> str:
    """The text of a content part of a `role` message; DropSample for anything but a text part."""
    example = '{"type": "text", "text": "..."}'
    if not isinstance(part, dict):
        raise DropSample(f"{role} content is a list of other things than content parts ({example})")
    if "type" not in part:
        raise DropSample(f"{role} content has a part without a type (keys {', '.join(map(str, part))}): write it as "
                         f"{example}")
    if part["type"] in IMAGE_PARTS:
        raise DropSample(f"{role} content has an image: this model takes none (images train on the vision-language "
                         "checkpoints of docs/data.md: Images)")
    if part["type"] != "text":
        raise DropSample(f"{role} content has a {part['type']!r} part: only text and image parts train (video and "
                         "audio are not supported yet)")
    if not isinstance(part.get("text"), str):
        found = "no text" if part.get("text") is None else f"a text that is {type(part['text']).__name__}"
        raise DropSample(f"{role} content has a text part with {found}, expected a string: {example}")
    return part["text"]


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
        for key in ("content", *REASONING_FIELDS):
            with_images = key == "content" and isinstance(content, list) and IMAGE_PART in content
            if m.get(key) is not None and not isinstance(m[key], str) and not with_images:
                raise DropSample(f"{m['role']} {key} is {type(m[key]).__name__}, expected a string")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise DropSample(f"{m['role']} tool_calls is {type(calls).__name__}, expected a list of calls "
                             "({\"type\": \"function\", \"function\": {\"name\", \"arguments\"}})")
    if not any(m["role"] == "assistant" for m in messages):
        raise DropSample("no assistant turn")


def normalise_reasoning(messages: list[dict], field: str | None) -> tuple[list[dict], int]:
    """The messages with each assistant turn's reasoning where the template reads it (`field`, or
    inline in content when None), and the number of assistant turns that carry reasoning. A message
    with both a reasoning field and an inline block keeps its content as written."""
    out, carried = [], 0
    for m in messages:
        content = m.get("content")
        inline = _INLINE_REASONING.match(content) if m["role"] == "assistant" and isinstance(content, str) else None
        fields = [m[f] for f in (field, *REASONING_FIELDS) if f and m.get(f)] if m["role"] == "assistant" else []
        if not (inline or fields):
            out.append(m)
            continue
        m = {key: value for key, value in m.items() if key not in REASONING_FIELDS}
        reasoning = fields[0] if fields else inline.group(1).strip("\n")
        carried += bool(reasoning.strip())
        if field is not None:
            m[field] = reasoning
            if not fields:
                m["content"] = content[inline.end():].lstrip("\n")
        elif not inline:
            think = f"<think>\n{reasoning}\n</think>\n\n"
            m["content"] = [{"type": "text", "text": think}, *content] if isinstance(content, list) else \
                think + (content or "")
        out.append(m)
    return out, carried


def _render(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]], tools: list | None,
            template_kwargs: dict, add_generation_prompt: bool = False,
            generation_spans: bool = False) -> tuple[list[str], list]:
    """Texts (and {% generation %} character spans) of several conversations in one call.

    The same renderer as `apply_chat_template` (which cannot return the spans without tokenising):
    the tokenizer's special tokens and data.chat_template_kwargs as template variables, messages
    without their None-valued keys.
    """
    conversations = [[{k: v for k, v in m.items() if v is not None} for m in c] for c in conversations]
    try:
        return render_jinja_template(conversations, tools=tools, chat_template=tokenizer.get_chat_template(None, tools),
                                     add_generation_prompt=add_generation_prompt,
                                     return_assistant_tokens_mask=generation_spans,
                                     **{**tokenizer.special_tokens_map, **template_kwargs})
    except jinja2.TemplateError as e:  # e.g. raise_exception('Conversation roles must alternate ...')
        raise DropSample(f"the chat template refused the conversation: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field of a shape the template cannot render
        raise DropSample(f"the chat template failed on the conversation ({type(e).__name__}: {e})") from None


Row = tuple[str, list[tuple[int, int]], tuple[int, ...]]
"""A row's text, the character span of each supervised turn in it, and those turns' numbers."""


def _tagged_row(tokenizer, messages, tools, template_kwargs) -> Row:
    """The whole conversation in one row, supervised where the template marks {% generation %}."""
    (text,), (marked,) = _render(tokenizer, [messages], tools, template_kwargs, generation_spans=True)
    spans: list[list[int]] = []
    for start, end in sorted(marked):  # one turn marked in several touching blocks is one segment
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    if not spans:
        raise DropSample(NOTHING_MARKED)
    return text, [(start, end) for start, end in spans], tuple(range(len(spans)))


def _generated_rows(tokenizer, messages, tools, template_kwargs, last_turn_only: bool) -> list[Row]:
    """Rows that hold each assistant turn as generated: the fewest the rendering allows, in turn order."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompts, _ = _render(tokenizer, [messages[:i] for i in turns], tools, template_kwargs, add_generation_prompt=True)
    full = [messages] if turns[-1] != len(messages) - 1 else []
    throughs, _ = _render(tokenizer, [messages[: i + 1] for i in turns] + full, tools, template_kwargs)
    whole = throughs[-1]
    generated = [k for k, (prompt, through) in enumerate(zip(prompts, throughs)) if through.startswith(prompt)]
    if len(generated) < len(turns) and not (last_turn_only and generated[-1:] == [len(turns) - 1]):
        raise DropSample(GENERATION_PROMPT_MISMATCH)
    # Greedy from the last turn: a row is the whole conversation if it holds that turn as generated
    # (always, for prefix-preserving templates), else the rendering through that turn; every earlier
    # turn the row holds as generated, ending before the next member's prompt, shares it.
    pending, rows = generated, []
    while pending:
        anchor = pending[-1]
        text = whole if whole.startswith(throughs[anchor]) else throughs[anchor]
        members, prompt_start = [], len(text)
        for k in reversed(pending):
            if len(throughs[k]) <= prompt_start and text.startswith(throughs[k]):
                members.append(k)
                prompt_start = len(prompts[k])
        members.reverse()
        rows.append((text, [(len(prompts[k]), len(throughs[k])) for k in members], tuple(members)))
        pending = [k for k in pending if k not in members]
    return rows[::-1]


def _segments(text: str, spans: list[tuple[int, int]], supervised: list[bool]) -> list[Segment]:
    """The row's text cut at the turn spans; a span's segment is supervised where `supervised` says.
    A turn's segment ends at its last non-whitespace character: whitespace after the end-of-turn
    token goes to the next prompt segment."""
    segments: list[Segment] = []
    pos = 0
    for (start, end), trained in zip(spans, supervised):
        end = start + len(text[start:end].rstrip())
        if end == start:
            continue
        if start > pos:
            segments.append((text[pos:start], False))
        segments.append((text[start:end], trained))
        pos = end
    if pos < len(text):
        segments.append((text[pos:], False))
    if not any(trained for _, trained in segments):
        raise DropSample(NOTHING_MARKED)
    if len(segments) == 1:
        raise DropSample("the chat template marked every token as assistant")
    return segments


def render_rows(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list | None,
                last_turn_only: bool = False, template_kwargs: dict | None = None, images: bool = False
                ) -> tuple[list[RowPlan], int]:
    """The conversation's training rows (see the module docstring) and how many of its assistant turns
    carry reasoning; `images`: the model takes image parts. Raises DropSample."""
    messages = joined_content_parts(messages, images)
    validate_messages(messages)
    messages, reasoning_turns = normalise_reasoning(messages, reasoning_field(tokenizer))
    template_kwargs = template_kwargs or {}
    if has_generation_tags(tokenizer):
        rows = [_tagged_row(tokenizer, messages, tools, template_kwargs)]
    else:
        rows = _generated_rows(tokenizer, messages, tools, template_kwargs, last_turn_only)
    if last_turn_only:
        # The row holding the last turn, with the others as context. Their segments stay cut as in
        # that row, so this option changes the labels, never the tokens.
        text, spans, turns = rows[-1]
        return [RowPlan(_segments(text, spans, [turn == turns[-1] for turn in turns]), turns[-1:])], reasoning_turns
    return [RowPlan(_segments(text, spans, [True] * len(spans)), turns) for text, spans, turns in rows], reasoning_turns


def encode_segments(tokenizer: PreTrainedTokenizerBase,
                    rows: list[list[Segment]]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each row: its segments tokenised one by one, in one batched call."""
    texts = [text for segments in rows for text, _ in segments]
    if not texts:
        return []
    encoded = iter(tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"])
    out = []
    for segments in rows:
        ids, labels = [], []
        for _, supervised in segments:
            piece = next(encoded)
            ids += piece
            labels += piece if supervised else [IGNORE_INDEX] * len(piece)
        out.append((ids, labels))
    return out


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list | None,
                          max_seq_len: int, last_turn_only: bool = False, template_kwargs: dict | None = None
                          ) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each training row, labels = input_ids on supervised tokens, IGNORE_INDEX
    elsewhere. Labels follow the Hugging Face convention (not shifted: the loss shifts). Raises
    DropSample for the first row that cannot be trained."""
    plans, _ = render_rows(tokenizer, messages, tools, last_turn_only, template_kwargs)
    return [truncate_tokenized(ids, labels, max_seq_len)
            for ids, labels in encode_segments(tokenizer, [plan.segments for plan in plans])]


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
