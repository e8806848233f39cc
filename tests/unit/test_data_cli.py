"""`python -m sft.data`: samples with the trained tokens marked, and the data statistics."""

import json

from transformers import AutoTokenizer

from helpers import DEMO_MODEL, REPO, run_cli
from real_tokenizers import QWEN3_STYLE_TEMPLATE, real_tokenizer
from sft.data.__main__ import main
from sft.data.masking import tokenize_conversation

CONFIG = str(REPO / "configs" / "demo.yaml")


def run(capsys, tmp_path, *overrides):
    main(["--config", CONFIG, "--show", "1", "--stats", f"model.name_or_path={DEMO_MODEL}",
          f"data.cache_dir={tmp_path / 'cache'}", *overrides])  # a later --show wins
    return capsys.readouterr().out


def test_demo_config_shows_marked_samples_and_packing(capsys, tmp_path, demo_data):
    out = run(capsys, tmp_path, f"data.path={demo_data}/train.jsonl", f"data.eval_path={demo_data}/eval.jsonl",
              "data.packing=true")
    assert "train: kept 200/200 rows" in out and "eval: kept 40/40 rows" in out
    sample = out.split("--- sample 0", 1)[1].split("\n", 1)[1].split("train: kept", 1)[0]
    # Not a terminal: trained spans in brackets, each ending with the end-of-turn token.
    assert sample.count("[[") == sample.count("<|im_end|>]]") > 0
    assert "[[<|im_start|>" not in sample and "user\n[[" not in sample
    assert "packing: " in out and " rows of 256, fill " in out


def test_drops_truncation_and_token_stats(capsys, tmp_path):
    answer = " ".join(["word"] * 60)
    rows = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
            [{"role": "user", "content": "no answer"}],
            [{"role": "user", "content": "Long?"}, {"role": "assistant", "content": answer}]]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": rows[0]}) + "\n\n" + "".join(json.dumps({"messages": r}) + "\n"
                                                                         for r in rows[1:]))
    out = run(capsys, tmp_path, f"data.path={path}", "data.eval_path=null", "data.max_seq_len=40")
    assert "train: kept 2/3 rows" in out
    assert "  dropped 1: no assistant turn (first: line 3)" in out
    assert "  cut by data.max_seq_len=40: 1 samples" in out
    # Expected numbers from the tokenizer alone (the demo vocabulary has no merges across turns, so
    # whole-string and segment-wise tokenisation agree): the long answer is cut at 40 tokens.
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    short = len(tok.apply_chat_template(rows[0])["input_ids"])
    short_trained = len(tok("Hello.<|im_end|>", add_special_tokens=False)["input_ids"])
    long_prompt = len(tok.apply_chat_template(rows[2][:1], add_generation_prompt=True)["input_ids"])
    assert len(tok.apply_chat_template(rows[2])["input_ids"]) > 40
    low, high = sorted([short, 40])
    assert f"  tokens per sample: min {low}, median {(low + high) // 2}, p99 {int(low + 0.99 * (high - low))}, " \
           f"max {high}; {low + high} in all" in out
    trained = short_trained + 40 - long_prompt
    assert f"  supervised: {trained} tokens ({trained / (low + high):.1%})" in out


def test_module_entry_point_reports_bad_data_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [}\n')
    status, _, err = run_cli(main, ["--config", CONFIG, f"model.name_or_path={DEMO_MODEL}", f"data.path={path}",
                                    "data.eval_path=null", f"data.cache_dir={tmp_path / 'cache'}"], capsys)
    assert status == 2
    assert err.strip().splitlines() == [
        f"error: data.path='{path}': line 1 is not valid JSON: Expecting value: line 1 column 15 (char 14)"]


def test_expanded_rows_are_shown_as_such(capsys, tmp_path):
    """A history-rewriting template: each row says which turn of which line it trains; --stats gives the cost."""
    tok = real_tokenizer("qwen2")
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    tok.save_pretrained(tmp_path / "tokenizer")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "Greet."},
                {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "<think>Polite.</think>Sure."}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n" + json.dumps({"messages": messages}) + "\n")
    out = run(capsys, tmp_path, f"data.path={path}", "data.eval_path=null", f"model.tokenizer={tmp_path / 'tokenizer'}",
              "--show", "3")
    lengths = [len(ids) for ids, _ in tokenize_conversation(tok, messages, None, max_seq_len=256)]
    for part in range(3):
        assert (f"--- sample {part} ({lengths[part]} tokens, line 2 of {path}, row {part + 1}/3 of that conversation: "
                f"assistant turn {part + 1} of 3; trained: [[...]])") in out
    assert "[[<think>\nGreet.\n</think>\n\nHello!<|im_end|>]]" in out
    assert "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2 + 2?" in out  # history, untrained
    assert "train: kept 3/3 rows" in out
    assert (f"  expansion: 1/1 conversations expanded to one row per turn group, as the chat template rewrites history: "
            f"+2 rows, +{lengths[0] + lengths[1]:,} tokens ({(lengths[0] + lengths[1]) / sum(lengths):.1%} of the tokens)"
            ) in out
    assert "  reasoning: 2/3 assistant turns carry reasoning, passed to the chat template as reasoning_content" in out


# A content part that is not a text part as written, and the reason its row is dropped for (never a
# traceback, never an empty turn that trains)
BAD_PARTS = {
    '{"type": "text", "text": 5}': "user content has a text part with a text that is int, expected a string",
    '{"type": "text"}': "user content has a text part with no text, expected a string",
    '{"type": "text", "text": null}': "user content has a text part with no text, expected a string",
    '{"text": "hi"}': "user content has a part without a type (keys text)",
    '{"image_url": {"url": "x.png"}}': "user content has a part without a type (keys image_url)",
    '{"type": "image_url", "image_url": {"url": "x.png"}}': "user content has an image: this model takes none",
    '"hi"': "user content is a list of other things than content parts",
}


def test_content_parts_that_are_not_text_parts_drop_their_row_with_the_reason(capsys, tmp_path):
    good = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": "Hello."}]
    lines = [json.dumps({"messages": good})]
    lines += ['{"messages": [{"role": "user", "content": [%s]}, {"role": "assistant", "content": "x"}]}' % part
              for part in BAD_PARTS]
    lines.append(json.dumps({"messages": [{"role": "user", "content": []}, {"role": "assistant", "content": "x"}]}))
    path = tmp_path / "parts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = run(capsys, tmp_path, f"data.path={path}", "data.eval_path=null")
    assert f"train: kept 1/{len(lines)} rows" in out
    # the two text parts with no text share their reason: the first row counts
    reasons = {reason: line for line, reason in reversed(list(enumerate(
        [*BAD_PARTS.values(), "user content is an empty list of content parts"], start=2)))}
    for reason, line in reasons.items():
        count = list(BAD_PARTS.values()).count(reason) or 1
        shown = [text for text in out.splitlines() if text.startswith(f"  dropped {count}: {reason}")]
        assert len(shown) == 1 and shown[0].endswith(f"(first: line {line})"), (reason, out)
