"""Data formats, drop accounting, bad inputs, and the step sampler."""

import json

import pandas as pd
import pytest
from transformers import AutoTokenizer

from helpers import DEMO_MODEL
from sft.config import DataConfig
from sft.data.sources import DataError, load_rows
from sft.data.batches import StepSampler
from sft.data.prepare import _tokenize, load_sft_data

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell 'cat'."},
     {"role": "assistant", "content": "c-a-t"}, {"role": "user", "content": "Reverse it."},
     {"role": "assistant", "content": "tac"}],
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def load(tok, path, **kw):
    cfg = DataConfig(path=str(path), cache_dir=str(path.parent / "cache"), **kw)
    return load_sft_data(cfg, tok, seed=0)


def as_set(ds):
    return sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in ds)


def test_three_formats_give_identical_tokens(tmp_path, tok):
    messages = tmp_path / "m.jsonl"
    messages.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]}
                                                       for m in c]} for c in CONVERSATIONS]))
    single = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": [CONVERSATIONS[0][0]["content"]],
                  "completion": [CONVERSATIONS[0][1]["content"]]}).to_parquet(single)

    from_messages, _ = load(tok, messages)
    from_sharegpt, _ = load(tok, sharegpt)
    from_prompt, _ = load(tok, single)
    assert len(from_messages) == 2
    assert as_set(from_messages) == as_set(from_sharegpt)
    assert as_set(from_prompt)[0] in as_set(from_messages)


def test_tools_column_and_tool_calls(tmp_path, tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                        {"role": "tool", "content": "sunny"},
                        {"role": "assistant", "content": "Sunny."}],
           "tools": json.dumps(tools)}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"messages": CONVERSATIONS[0], "tools": ""}) + "\n")
    train, _ = load(tok, path)
    texts = sorted(tok.decode(r["input_ids"]) for r in train)
    assert len(texts) == 2 and "Weather?" in texts[0]
    assert '# Tools\n{"type": "function", "function": {"name": "get_weather"' in texts[0]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in texts[0]


def test_bad_rows_are_dropped_and_counted(tmp_path, tok, capsys):
    no_answer = {"messages": [{"role": "user", "content": "no answer"}]}
    rows = [{"messages": CONVERSATIONS[0]}, no_answer,
            {"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]},
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok"}]},
            # the chat template's tojson cannot render a string where it expects a list of calls
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                            "tool_calls": "get_weather(city='Paris')"}]},
            no_answer, no_answer, no_answer]
    path = tmp_path / "bad.jsonl"
    # A blank line (datasets skips it) and the shuffle must not shift the line numbers reported, and
    # the first in the file is reported, not the first in the shuffled order.
    path.write_text(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))
    train, _ = load(tok, path)
    assert len(train) == 2
    out = capsys.readouterr().out
    assert f"dropped 4/8 train samples: no assistant turn (first: line 3 of {path})" in out
    assert f"dropped 1/8 train samples: unknown role 'wizard' (known: system, user, assistant, tool) (first: line 4 of {path})" in out
    assert "dropped 1/8 train samples: assistant tool_calls is str, expected a list of calls" in out
    assert f"(first: line 6 of {path})" in out
    assert sorted(train["source_row"]) == [0, 3]


def test_every_sample_dropped_is_an_error(tmp_path, tok):
    path = tmp_path / "none.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="every train sample was dropped.*no assistant turn"):
        load(tok, path)


def test_every_eval_sample_dropped_names_the_eval_key(tmp_path, tok):
    good = tmp_path / "train.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=f"^data.eval_path={bad}: every eval sample was dropped "
                                        r"\(1x no assistant turn\); nothing to evaluate on$"):
        load(tok, good, eval_path=str(bad))


@pytest.mark.parametrize("content, message, suffix", [
    (None, "file not found", "jsonl"),
    ("", "the dataset is empty", "jsonl"),
    ("\n  \n\n", "the dataset is empty \\(only blank lines\\)", "jsonl"),
    ('{"messages": []}\n\n{"messages": [}\n', "line 3 is not valid JSON: Expecting value: line 1 column 15", "jsonl"),
    ('{"messages": []}\n[1, 2]\n', "line 2 is a JSON list, expected one object per line", "jsonl"),
    (b'{"messages": []}\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n',
     "line 2 is not UTF-8 text \\(byte 0xe9 at column 47\\); convert the file to UTF-8", "jsonl"),
    # a JSON (not JSON lines) file: the same line, not datasets' DatasetGenerationError
    (b'[{"messages": []},\n {"messages": [{"role": "user", "content": "caf\xe9"}]}]\n',
     "line 2 is not UTF-8 text \\(byte 0xe9 at column 48\\); convert the file to UTF-8", "json"),
    ('{"text": "hello"}\n', "no 'messages', 'conversations', 'prompt'\\+'completion' or 'input_ids'\\+'labels' column \\(found: text\\)", "jsonl"),
])
def test_bad_files_give_one_clear_error(tmp_path, tok, content, message, suffix):
    path = tmp_path / f"f.{suffix}"
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=message):
        load(tok, path)


def test_eval_split_is_held_out(tmp_path, tok):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"messages": CONVERSATIONS[i % 2] + [
        {"role": "user", "content": f"n{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n" for i in range(20)))
    train, evals = load(tok, path, eval_fraction=0.2)
    assert len(train) == 16 and len(evals) == 4
    assert not set(as_set(train)) & set(as_set(evals))


def test_sampler_partitions_each_global_batch():
    n = 103
    for world, ga, mb in ((1, 4, 2), (2, 2, 2), (4, 1, 2)):
        samplers = [StepSampler(n, mb, ga, mb * ga * world, r, seed=3) for r in range(world)]
        assert samplers[0].global_batch == 8 and samplers[0].steps_per_epoch == 12
        for step in (0, 5, 12, 13):  # 12, 13: second epoch, another order
            per_rank = [sum(s.micro_batches(step), []) for s in samplers]
            flat = sum(per_rank, [])
            assert len(flat) == len(set(flat)) == 8
            assert sorted(flat) == sorted(StepSampler(n, 8, 1, 8, 0, seed=3).micro_batches(step)[0])
    assert StepSampler(n, 8, 1, 8, 0, 3).micro_batches(0) != StepSampler(n, 8, 1, 8, 0, 3).micro_batches(12)


def test_a_first_batch_of_only_dropped_rows(tmp_path, tok):
    """datasets.map tokenises 1,000 rows at a time: a first batch without a single token must not fix
    the column types (lists of nulls) for the batches after it."""
    path = tmp_path / "m.jsonl"
    unanswered = json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n"
    path.write_text(unanswered * 1000 + "".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"))
    rows = load_rows(cfg.path, None, "train", cfg.cache_dir, "data.path")  # unshuffled: the drops come first
    kept, report = _tokenize(rows, tok, cfg, cfg.path, "data.path", "train")
    assert sorted(kept["source_row"]) == [1000, 1001] and report.drops["no assistant turn"][0] == 1000
