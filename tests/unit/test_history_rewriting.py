"""Chat templates that rewrite history (Qwen3's rule), on the real Qwen2/Qwen3 byte-level vocabulary.

For every case: every assistant turn is supervised in exactly one row, as the text the model generates
at that turn (written out below by hand, through <|im_end|>), and nothing else is; the row's text up to
the turn is the inference prompt render(messages[:k], add_generation_prompt=True), and before a row's
first supervised turn its tokens are that prompt tokenised in one piece, as a chat server does.
"""

import json
from types import SimpleNamespace

import pytest

from helpers import supervised_spans
from real_tokenizers import QWEN25_TEMPLATE, QWEN3_STYLE_TEMPLATE, real_tokenizer
from sft.config import DataConfig
from sft.data.prepare import prepare_sft_data
from sft.data.masking import DropSample, normalise_reasoning, reasoning_field, tokenize_conversation

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALL_TEXT = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def user(text):
    return {"role": "user", "content": text}


def assistant(text, calls=None, **reasoning):
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}), **reasoning}


def tool(text):
    return {"role": "tool", "content": text}


def think(reasoning=""):
    return f"<think>\n{reasoning}\n</think>\n\n"


END = "<|im_end|>"
# name -> (messages, the text generated at each assistant turn, rows)
CASES = {
    "single_turn": ([user("2 + 2?"), assistant("4.")], [think() + "4." + END], 1),
    "single_turn_reasoning": ([user("2 + 2?"), assistant("\n4.", reasoning_content="Two and two.")],
                              [think("Two and two.") + "\n4." + END], 1),
    "multi_turn": ([user("Hi"), assistant("Hello!"), user("2 + 2?"), assistant("\n\n4"), user("Thanks"),
                    assistant("You're welcome.")],
                   [think() + "Hello!" + END, think() + "\n\n4" + END, think() + "You're welcome." + END], 3),
    **{f"multi_turn_{field}": ([user("2 + 2?"), assistant("4.", **{field: "Add them."}), user("Times 3?"),
                                assistant("12.", **{field: "\nMultiply.\n"})],
                               [think("Add them.") + "4." + END, think("Multiply.") + "12." + END], 2)
       for field in ("reasoning_content", "reasoning", "thinking")},
    "think_in_content": ([user("2 + 2?"), assistant("<think>\nAdd them.\n</think>\n\n4."), user("Times 3?"),
                          assistant("<think>Multiply.</think>12.")],
                         [think("Add them.") + "4." + END, think("Multiply.") + "12." + END], 2),
    "agentic_tool_steps": ([user("Weather in Paris?"), assistant("", [CALL], reasoning_content="Look it up."),
                            tool("sunny"), assistant("Checking again.", [CALL]), tool("still sunny"),
                            assistant("Sunny.", reasoning_content="Both agree.")],
                           [think("Look it up.") + CALL_TEXT + END, think() + "Checking again." + CALL_TEXT + END,
                            think("Both agree.") + "Sunny." + END], 1),
    "tool_response_as_user": ([user("Weather?"), assistant("", [CALL]), user("<tool_response>\nsunny\n</tool_response>"),
                               assistant("Sunny.")], [think() + CALL_TEXT + END, think() + "Sunny." + END], 1),
    "chat_then_tools": ([user("Hi"), assistant("Hello!", reasoning_content="Greet."), user("Weather in Paris?"),
                         assistant("", [CALL]), tool("sunny"), assistant("Sunny.")],
                        [think("Greet.") + "Hello!" + END, think() + CALL_TEXT + END, think() + "Sunny." + END], 2),
    "system_prompt": ([{"role": "system", "content": "Be brief."}, user("a"), assistant("b", reasoning_content="r"),
                       user("c"), assistant("d")], [think("r") + "b" + END, think() + "d" + END], 2),
}


@pytest.fixture(scope="module")
def tok():
    tok = real_tokenizer("qwen2")
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    return tok


def check_rows(tok, messages, generated, rows, tools=None, **template_kwargs):
    """Every turn trained once, as generated; prompts as at inference. Returns the turn each row trains."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompts = [tok.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False,
                                       **template_kwargs) for i in turns]
    trained = []
    for ids, labels in rows:
        row_turns = []
        for n, (start, end) in enumerate(supervised_spans(labels)):
            k = prompts.index(tok.decode(ids[:start]))  # the row up to the run is turn k's inference prompt
            assert tok.decode(ids[start:end]) == generated[k]
            assert ids[start:end] == tok(generated[k], add_special_tokens=False)["input_ids"]
            if n == 0:
                assert ids[:start] == tok.apply_chat_template(messages[:turns[k]], tools=tools, add_generation_prompt=True,
                                                              **template_kwargs)["input_ids"]
            row_turns.append(k)
        # The row is the rendering through its last trained turn, or the whole conversation: nothing after.
        through, whole = (tok.apply_chat_template(part, tools=tools, tokenize=False, **template_kwargs)
                          for part in (messages[:turns[row_turns[-1]] + 1], messages))
        assert tok.decode(ids) in (through, whole)
        trained.append(row_turns)
    assert sorted(k for row in trained for k in row) == list(range(len(turns)))
    return trained


@pytest.mark.parametrize("case", CASES)
def test_every_turn_is_trained_as_generated(tok, case):
    messages, generated, expected_rows = CASES[case]
    tools = TOOLS if any(m.get("tool_calls") for m in messages) else None
    rows = tokenize_conversation(tok, messages, tools, max_seq_len=4096)
    assert len(rows) == expected_rows
    check_rows(tok, messages, generated, rows, tools)


def test_turns_after_the_last_user_query_share_a_row(tok):
    messages, generated, _ = CASES["chat_then_tools"]
    rows = tokenize_conversation(tok, messages, TOOLS, max_seq_len=4096)
    assert check_rows(tok, messages, generated, rows, TOOLS) == [[0], [1, 2]]
    # The first turn is history in the second row: its content without the think block, not trained.
    assert "<|im_start|>assistant\nHello!<|im_end|>" in tok.decode(rows[1][0])


def test_enable_thinking_false_from_the_config(tok):
    messages = [user("2 + 2?"), assistant("4."), user("Times 3?"), assistant("12.")]
    rows = tokenize_conversation(tok, messages, None, max_seq_len=4096, template_kwargs={"enable_thinking": False})
    # The empty think block is part of the generation prompt now, not generated.
    check_rows(tok, messages, ["4." + END, "12." + END], rows, enable_thinking=False)
    assert tok.decode(rows[0][0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n4.<|im_end|>\n")
    # Reasoning the model cannot generate with thinking off: that turn has no generated text to train.
    reasoned = [user("2 + 2?"), assistant("4.", reasoning="Add them."), user("Times 3?"), assistant("12.")]
    with pytest.raises(DropSample, match="not as a continuation of its generation prompt.*enable_thinking"):
        tokenize_conversation(tok, reasoned, None, max_seq_len=4096, template_kwargs={"enable_thinking": False})
    # Training the last turn only needs only the last turn to be generated; the first is history.
    (ids, labels), = tokenize_conversation(tok, reasoned, None, max_seq_len=4096, last_turn_only=True,
                                           template_kwargs={"enable_thinking": False})
    (start, end), = supervised_spans(labels)
    assert tok.decode(ids[start:end]) == "12." + END
    assert ids[:start] == tok.apply_chat_template(reasoned[:-1], add_generation_prompt=True,
                                                  enable_thinking=False)["input_ids"]


def test_last_assistant_trains_the_final_turn_in_one_row(tok):
    messages, generated, _ = CASES["multi_turn"]
    (ids, labels), = tokenize_conversation(tok, messages, None, max_seq_len=4096, last_turn_only=True)
    (start, end), = supervised_spans(labels)
    assert tok.decode(ids[start:end]) == generated[-1]
    assert ids[:start] == tok.apply_chat_template(messages[:-1], add_generation_prompt=True)["input_ids"]


def test_truncation_cuts_an_expanded_row(tok):
    messages, generated, _ = CASES["multi_turn"]
    full = tokenize_conversation(tok, messages, None, max_seq_len=4096)
    cut = len(full[2][0]) - 4  # the last row loses "welcome", ".", <|im_end|> and "\n"
    assert len(full[1][0]) <= cut
    rows = tokenize_conversation(tok, messages, None, max_seq_len=cut)
    assert rows[:2] == full[:2] and rows[2] == (full[2][0][:cut], full[2][1][:cut])
    (start, end), = supervised_spans(rows[2][1])
    assert tok.decode(rows[2][0][start:end]) == think() + "You're"


def test_reasoning_field_is_the_one_the_template_reads(tok):
    assert reasoning_field(tok) == "reasoning_content"
    assert reasoning_field(SimpleNamespace(chat_template=QWEN25_TEMPLATE)) is None
    gpt_oss_like = "{%- if enable_thinking -%}{{ m.thinking }}{%- endif -%}{{ reasoning_effort }}"
    assert reasoning_field(SimpleNamespace(chat_template=gpt_oss_like)) == "thinking"
    # A template that reads no field gets the reasoning inline, as R1-distill templates expect.
    messages = [user("q"), assistant("4.", reasoning="Add."), assistant("<think>x</think>5")]
    assert normalise_reasoning(messages, None) == (
        [user("q"), assistant("<think>\nAdd.\n</think>\n\n4."), assistant("<think>x</think>5")], 2)
    assert normalise_reasoning(messages, "reasoning_content") == (
        [user("q"), assistant("4.", reasoning_content="Add."), assistant("5", reasoning_content="x")], 2)


def test_data_pipeline_keeps_every_conversation_and_reports_the_cost(tok, tmp_path):
    path = tmp_path / "chats.jsonl"
    cases = list(CASES.values())
    path.write_text("".join(json.dumps({"messages": messages, **({"tools": TOOLS} if any(
        m.get("tool_calls") for m in messages) else {})}) + "\n" for messages, _, _ in cases))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), eval_fraction=0.3)
    train, evals, reports = prepare_sft_data(cfg, tok, seed=0)
    # No conversation dropped, each split holds whole conversations, every turn trained once.
    assert sum(report.drops == {} for report in reports.values()) == 2
    assert len(train) + len(evals) == sum(rows for _, _, rows in cases)
    assert not set(train["source_row"]) & set(evals["source_row"])
    for split in (train, evals):
        for source_row in set(split["source_row"]):
            mine = [r for r in split if r["source_row"] == source_row]
            messages, generated, rows = cases[source_row]
            assert [r["part"] for r in mine] == list(range(rows)) and {r["parts"] for r in mine} == {rows}
            assert sorted(t for r in mine for t in r["turns"]) == list(range(len(generated)))
            check_rows(tok, messages, generated, [(r["input_ids"], r["labels"]) for r in mine],
                       TOOLS if any(m.get("tool_calls") for m in messages) else None)
    both = [reports["train"], reports["eval"]]
    assert sum(r.conversations for r in both) == len(cases)
    assert sum(r.expanded for r in both) == sum(rows > 1 for _, _, rows in cases) == 7
    assert sum(r.expansion_rows for r in both) == sum(rows - 1 for _, _, rows in cases) == 8
    assert sum(r.assistant_turns for r in both) == 23
    assert sum(r.reasoning_turns for r in both) == 13 and reports["train"].reasoning_field == "reasoning_content"
    # The extra rows' tokens: an expanded conversation's rows beyond its longest.
    for split, report in zip((train, evals), both):
        lengths = {}
        for r in split:
            lengths.setdefault(r["source_row"], []).append(r["length"])
        assert report.expansion_tokens == sum(sum(v) - max(v) for v in lengths.values()) > 0


def test_truncation_drops_only_the_rows_it_empties(tok, tmp_path):
    messages, _, _ = CASES["multi_turn"]
    rows = tokenize_conversation(tok, messages, None, max_seq_len=4096)
    prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True)["input_ids"]
    assert len(rows[1][0]) < len(prompt)  # the last row's prompt is longer than the whole second row
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), max_seq_len=len(prompt))
    train, _, reports = prepare_sft_data(cfg, tok, seed=0)
    assert [r["turns"] for r in train] == [[0], [1]]
    assert reports["train"].drops == {"no supervised tokens left after truncation to data.max_seq_len": (1, "line 1")}


def test_last_assistant_does_not_expand(tok, tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": CASES[c][0]}) + "\n" for c in ("multi_turn", "think_in_content")))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), train_on="last_assistant")
    train, _, reports = prepare_sft_data(cfg, tok, seed=0)
    assert len(train) == 2 and reports["train"].expanded == 0
    assert sorted(len(supervised_spans(r["labels"])) for r in train) == [1, 1]


def test_rows_follow_the_rendering_not_the_model(tok, monkeypatch):
    """Qwen3's published template keeps the think block of a turn after the last query only if it has
    reasoning (or is the last message): a tool step without reasoning is rewritten once a later step
    follows, and gets its own row; the steps that keep their form share the whole conversation's row."""
    monkeypatch.setattr(tok, "chat_template", QWEN3_STYLE_TEMPLATE.replace(
        "{%- if loop.index0 > ns.last_query -%}", "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"))
    messages, generated, _ = CASES["agentic_tool_steps"]
    rows = tokenize_conversation(tok, messages, TOOLS, max_seq_len=4096)
    assert check_rows(tok, messages, generated, rows, TOOLS) == [[1], [0, 2]]


def test_template_kwargs_are_part_of_the_cache_key(tok, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [user("2 + 2?"), assistant("4.")]}) + "\n")
    trained = []
    for thinking in (True, False):
        cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"),
                         chat_template_kwargs={"enable_thinking": thinking})
        train, _, _ = prepare_sft_data(cfg, tok, seed=0)
        (ids, labels), = zip(train["input_ids"], train["labels"])
        trained.append([tok.decode(ids[start:end]) for start, end in supervised_spans(labels)])
    # The same text either way; with thinking off the empty think block is prompt, not trained.
    assert trained == [[think() + "4." + END], ["4." + END]]
