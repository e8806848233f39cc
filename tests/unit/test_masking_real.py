"""Masks on real vocabularies (Qwen2's byte-level BPE merges whitespace; Llama-3's has header tokens).

For every case: each supervised span is exactly the tokens of the turn's own text + end-of-turn
token (tokenised on its own, decoded back to that text), and the prompt before the first reply is
token for token what `apply_chat_template(..., add_generation_prompt=True)` gives at inference.
"""

import hashlib
import importlib.util
import json
import random

import pytest

from helpers import DEMO_MODEL, REPO, supervised_spans
from real_tokenizers import END_OF_TURN, real_tokenizer
from sft.data.masking import DropSample, tokenize_conversation

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ARGS = json.dumps(CALL["function"]["arguments"])


def user(text):
    return {"role": "user", "content": text}


def assistant(text, calls=None):
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


CASES = {
    "newline_start": [user("2 + 2?"), assistant("\nThe answer is 4.")],
    "two_newlines_start": [user("2 + 2?"), assistant("\n\nThe answer is 4.")],
    "spaces_newline_start": [user("Indent?"), assistant("  \n  indented")],
    "later_turn_newline_start": [user("Hi"), assistant("Hello!"), user("2 + 2?"), assistant("\n\n4")],
    "trailing_whitespace": [user("Hi"), assistant("Done.\n\n"), user("More?"), assistant("Yes.  ")],
    "code_block": [user("Code?"), assistant("Here:\n\n```python\ndef f(x):\n    return x + 1\n```\n")],
    "crlf": [user("Two lines\r\nplease"), assistant("line one\r\nline two\r\n")],
    "non_ascii": [user("Größe?"), assistant("Die Größe von 東京 ist ✓ — très grand.")],
    "system_multi_turn": [{"role": "system", "content": "Be brief.\n"}, user("a"), assistant("b"), user("c"),
                          assistant("d\n")],
    "tool_call_after_newline": [user("Weather in Paris?"), assistant("\nLet me check.", [CALL]),
                                {"role": "tool", "content": "sunny, 21 C"}, assistant("\nIt is sunny.")],
}


def expected_turn_text(name: str, message: dict) -> str:
    """What the model must produce for this turn under each model's own template."""
    if name == "llama3":  # Llama-3.1 trims content; a tool call replaces the content
        if message.get("tool_calls"):
            return '{"name": "get_weather", "parameters": ' + ARGS + "}<|eot_id|>"
        return message["content"].strip() + "<|eot_id|>"
    text = message["content"]
    for _ in message.get("tool_calls", []):  # Qwen2.5's and the demo ChatML template's tool-call text
        text += ('\n<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + "}\n</tool_call>" if name == "qwen2"
                 else '<tool_call>{"name": "get_weather", "arguments": ' + ARGS + "}</tool_call>")
    return text + END_OF_TURN.get(name, "<|im_end|>")


@pytest.fixture(scope="module", params=["qwen2", "qwen2_generation_tags", "llama3"])
def template(request):
    """(name, tokenizer): Qwen2.5's template (prefix path), the demo's ChatML template with
    {% generation %} on the Qwen2 vocabulary (generation path), Llama-3.1's template."""
    tok = real_tokenizer(request.param.removesuffix("_generation_tags"))
    if request.param == "qwen2_generation_tags":
        tok.chat_template = (DEMO_MODEL / "chat_template.jinja").read_text()
    return request.param, tok


@pytest.mark.parametrize("case", CASES)
def test_supervised_tokens_are_the_turns_own_tokens(template, case):
    name, tok = template
    messages = CASES[case]
    tools = TOOLS if any(m.get("tool_calls") for m in messages) else None
    (ids, labels), = tokenize_conversation(tok, messages, tools, max_seq_len=4096)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(supervised_spans(labels)) == len(turns)
    for (start, end), i in zip(supervised_spans(labels), turns):
        expected = expected_turn_text(name, messages[i])
        assert tok.decode(ids[start:end]) == expected
        assert ids[start:end] == tok(expected, add_special_tokens=False)["input_ids"]
        # Everything before the turn is the text the template renders as the inference prompt.
        prompt = tok.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False)
        assert tok.decode(ids[:start]) == prompt
    first = turns[0]
    inference_prompt = tok.apply_chat_template(messages[:first], tools=tools, add_generation_prompt=True)["input_ids"]
    assert ids[: supervised_spans(labels)[0][0]] == list(inference_prompt)
    # Nothing is left out: the row is the whole rendered conversation.
    assert tok.decode(ids) == tok.apply_chat_template(messages, tools=tools, tokenize=False)


def as_parts(messages: list[dict]) -> list[dict]:
    """The messages with each content as one OpenAI text part."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
            for m in messages]


@pytest.mark.parametrize("case", CASES)
def test_content_parts_train_as_their_text(template, case):
    """Rows whose content is a list of text parts train as the string they hold: the same tokens and
    labels, so the supervised text is the turn's own (the test above)."""
    _, tok = template
    messages = CASES[case]
    tools = TOOLS if any(m.get("tool_calls") for m in messages) else None
    assert (tokenize_conversation(tok, as_parts(messages), tools, max_seq_len=4096)
            == tokenize_conversation(tok, messages, tools, max_seq_len=4096))


def test_several_text_parts_join_by_newlines_and_an_image_part_drops_the_row(template):
    """Two text parts are one text with a newline between them (as vLLM joins them for a
    string-content template); an image part drops the row with a reason that names it."""
    name, tok = template
    parts = [user([{"type": "text", "text": "Describe"}, {"type": "text", "text": "briefly."}]),
             assistant([{"type": "text", "text": "A cat."}, {"type": "text", "text": "It sleeps."}])]
    joined = [user("Describe\nbriefly."), assistant("A cat.\nIt sleeps.")]
    (ids, labels), = tokenize_conversation(tok, parts, None, max_seq_len=4096)
    assert (ids, labels) == tokenize_conversation(tok, joined, None, max_seq_len=4096)[0]
    (start, end), = supervised_spans(labels)
    assert tok.decode(ids[start:end]) == expected_turn_text(name, joined[1])
    image = [user([{"type": "image_url", "image_url": {"url": "cat.png"}}, {"type": "text", "text": "What?"}]),
             assistant("A cat.")]
    with pytest.raises(DropSample, match="user content has an image: this model takes none"):
        tokenize_conversation(tok, image, None, max_seq_len=4096)


def test_whitespace_merges_are_real():
    """The reason this file exists: whole-string tokenisation merges the generation prompt's
    newline with the reply's. If this stops holding, the cases above no longer test anything."""
    tok = real_tokenizer("qwen2")
    whole = tok.convert_ids_to_tokens(tok("<|im_start|>assistant\n\nThe", add_special_tokens=False)["input_ids"])
    assert whole == ["<|im_start|>", "assistant", "ĊĊ", "The"]
    # "\n\n", "  ", "():\n" are single tokens. (Qwen2's pre-tokenizer splits "\n" from the spaces
    # after it, so it has no "\n  " token.)
    assert all(token in tok.get_vocab() for token in ("ĊĊ", "ĠĠ", "():Ċ"))


GOLDEN = json.loads((REPO / "tests" / "golden" / "prefix_preserving_rows.json").read_text())
"""Rows of the masking code before history-rewriting templates were trained (issue #23, commit 707b786): for
each case above, and a sha256 over 200 conversations of the tokenisation benchmark's corpus. Written by
running CASES and _bench_corpus(200) through that commit's tokenize_conversation (one (ids, labels) per
conversation, max_seq_len=4096), for each template and train_on."""


def _bench_corpus(n: int) -> list[dict]:
    spec = importlib.util.spec_from_file_location("bench_tokenize", REPO / "scripts" / "bench_tokenize.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rng = random.Random(0)
    return [bench.conversation(rng) for _ in range(n)]


@pytest.mark.parametrize("train_on", ["all_assistant", "last_assistant"])
def test_prefix_preserving_templates_give_the_rows_of_before(template, train_on):
    """Qwen2.5 / Llama-3 data: one row per conversation, token for token and label for label what it was."""
    name, tok = template
    last = train_on == "last_assistant"
    for case, messages in CASES.items():
        tools = TOOLS if any(m.get("tool_calls") for m in messages) else None
        rows = tokenize_conversation(tok, messages, tools, max_seq_len=4096, last_turn_only=last)
        assert [list(rows[0])] == [GOLDEN[f"{name} {train_on} {case}"]] and len(rows) == 1, case
    digest = hashlib.sha256()
    for row in _bench_corpus(200):
        tools = json.loads(row["tools"]) if "tools" in row else None
        rows = tokenize_conversation(tok, row["messages"], tools, max_seq_len=4096, last_turn_only=last)
        assert len(rows) == 1
        digest.update(json.dumps(list(rows[0])).encode())
    assert digest.hexdigest() == GOLDEN[f"{name} {train_on} bench_corpus_200"]
