"""Golden masking tests: decode the supervised tokens and compare them with the assistant text."""

import json

import pytest
from transformers import AutoTokenizer

from helpers import DEMO_MODEL
from sft.data.masking import IGNORE_INDEX, DropSample, has_generation_tags, tokenize_conversation

# A Llama-3-style header template *without* {% generation %}, which injects its own system
# prompt (like Llama-3.1's "Cutting Knowledge Date"); masks come from prefix rendering.
LLAMA3_STYLE = (
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n' -}}"
    "{%- if tools -%}{{- 'Tools: ' + (tools | tojson) + '\\n' -}}{%- endif -%}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}{%- set msgs = messages[1:] -%}"
    "{%- else -%}{%- set msgs = messages -%}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- for m in msgs -%}"
    "{{- '<|start_header_id|>' + ('ipython' if m['role'] == 'tool' else m['role']) + '<|end_header_id|>\\n\\n' -}}"
    "{%- if m.get('tool_calls') -%}"
    "{%- for c in m['tool_calls'] -%}{{- (c['function'] | tojson) -}}{%- endfor -%}"
    "{%- else -%}{{- m['content'] -}}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
# No assistant turn is a continuation of its generation prompt: every header carries the total
# number of messages, so the user header before a turn changes once the turn is added.
COUNTS_MESSAGES = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + ' of ' + (messages | length | string) + '\\n'"
    " + m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@pytest.fixture(scope="module")
def chatml():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    assert has_generation_tags(tok)
    return tok


@pytest.fixture(scope="module")
def llama3():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3_STYLE
    assert not has_generation_tags(tok)
    return tok


def supervised_spans(tok, labels) -> list[str]:
    """Decoded text of each contiguous run of supervised tokens."""
    spans, run = [], []
    for label in labels + [IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            run.append(label)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans


MULTI_TURN = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 7 - 4?"},
    {"role": "assistant", "content": "7 - 4 = 3."},
]
SYSTEM = [{"role": "system", "content": "You are a careful tutor."}]
TOOL_USE = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris."},
]
CALL_TEXT = json.dumps(CALL["function"])


@pytest.mark.parametrize("template, eot, call_text", [
    ("chatml", "<|im_end|>", "<tool_call>" + CALL_TEXT + "</tool_call>"),
    ("llama3", "<|eot_id|>", CALL_TEXT),
])
@pytest.mark.parametrize("case", ["multi_turn", "with_system", "tool_use", "last_turn_only"])
def test_supervised_text_is_assistant_content_plus_end_of_turn(request, template, eot, call_text, case):
    tok = request.getfixturevalue(template)
    messages, tools, last_only = {
        "multi_turn": (MULTI_TURN, None, False),
        "with_system": (SYSTEM + MULTI_TURN, None, False),
        "tool_use": (TOOL_USE, TOOLS, False),
        "last_turn_only": (SYSTEM + MULTI_TURN, None, True),
    }[case]
    (ids, labels), = tokenize_conversation(tok, messages, tools, max_seq_len=4096, last_turn_only=last_only)
    expected = [(m["content"] or "") + (call_text if m.get("tool_calls") else "") + eot
                for m in messages if m["role"] == "assistant"]
    assert supervised_spans(tok, labels) == (expected[-1:] if last_only else expected)
    # Everything else (system prompt, injected date, user/tool text, headers) is masked.
    masked = tok.decode([i for i, lab in zip(ids, labels) if lab == IGNORE_INDEX])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in masked
    if template == "llama3":
        assert "Cutting Knowledge Date" in masked


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_truncation_mid_answer_keeps_the_partial_answer(request, template):
    tok = request.getfixturevalue(template)
    (full_ids, full_labels), = tokenize_conversation(tok, MULTI_TURN, None, max_seq_len=4096)
    first_answer_end = next(i for i in range(len(full_labels) - 1, 0, -1)
                            if full_labels[i] != IGNORE_INDEX and full_labels[i - 1] == IGNORE_INDEX)
    cut = first_answer_end + 3  # three tokens into the second answer
    (ids, labels), = tokenize_conversation(tok, MULTI_TURN, None, max_seq_len=cut)
    assert ids == full_ids[:cut] and labels == full_labels[:cut]
    spans = supervised_spans(tok, labels)
    assert spans[0].endswith(("<|im_end|>", "<|eot_id|>")) and "7 - 4 = 3.".startswith(spans[1])


def test_truncation_before_any_answer_drops(chatml):
    with pytest.raises(DropSample, match="no supervised tokens left after truncation"):
        tokenize_conversation(chatml, SYSTEM + MULTI_TURN, None, max_seq_len=8)


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], "unknown role 'robot'"),
    ([{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}],
     "user content is a list of other things than content parts"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "assistant message without content"),
    ([], "empty"),
])
def test_bad_conversations_are_dropped_with_a_reason(chatml, messages, reason):
    with pytest.raises(DropSample, match=reason):
        tokenize_conversation(chatml, messages, None, max_seq_len=64)


def test_turn_that_does_not_continue_its_generation_prompt_is_dropped():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tok.chat_template = COUNTS_MESSAGES
    with pytest.raises(DropSample, match="not as a continuation of its generation prompt"):
        tokenize_conversation(tok, MULTI_TURN, None, max_seq_len=4096)
