"""Tokenisation throughput of the data path (load_sft_data), in conversations per second.

    python scripts/bench_tokenize.py                 # 2,000 conversations, num_proc 1 and 2
    PYTHONPATH=/path/to/other/checkout python scripts/bench_tokenize.py   # compare another version

Synthetic corpus (seeded): 1-4 user/assistant turns, a system prompt in half of the
conversations, a tool call + tool response in 15%, code blocks, non-ASCII text, and ~4% of the
replies starting with one or two newlines. Tokenizer: the real Qwen2 vocabulary (151k tokens)
with Qwen2.5's chat template (tests/real_tokenizers.py fetches it once from PyPI), or with
`--template qwen3-style` a template that rewrites history (the cost of expansion). Each
measurement tokenises into a fresh datasets cache, so nothing is reused between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

# One core per process: the Rust tokenizer would otherwise spread a batch over every core, and
# "per process" would mean "per machine".
os.environ["TOKENIZERS_PARALLELISM"] = "false"
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from real_tokenizers import QWEN3_STYLE_TEMPLATE, real_tokenizer  # noqa: E402
from sft.config import DataConfig  # noqa: E402
from sft.data.prepare import load_sft_data# noqa: E402

WORDS = ("the model data token batch step loss value result answer because first then finally "
         "Paris weather city number function return list string größe café naïve 東京 данные").split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def reply(rng: random.Random) -> str:
    parts = [sentence(rng, rng.randint(5, 25)) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.2:
        parts.insert(1, "```python\ndef f(x):\n    return x + 1\n```")
    text = "\n\n".join(parts)
    if rng.random() < 0.04:
        text = rng.choice(["\n", "\n\n"]) + text
    return text


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": sentence(rng, 8)}] if rng.random() < 0.5 else []
    row = {}
    if rng.random() < 0.15:
        row["tools"] = json.dumps(TOOLS)
        messages += [{"role": "user", "content": "Weather in " + rng.choice(["Paris", "東京", "Zürich"]) + "?"},
                     {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "content": "sunny, 21 C"},
                     {"role": "assistant", "content": reply(rng)}]
    for _ in range(rng.randint(1, 4) - (1 if row else 0)):
        messages += [{"role": "user", "content": sentence(rng, rng.randint(4, 20))},
                     {"role": "assistant", "content": reply(rng)}]
    return {**row, "messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2, help="report the best of this many runs")
    parser.add_argument("--template", choices=["qwen2.5", "qwen3-style"], default="qwen2.5",
                        help="qwen3-style: our template with Qwen3's history rule (tests/real_tokenizers.py), so "
                             "multi-turn conversations are expanded into one row per turn")
    args = parser.parse_args()
    tokenizer = real_tokenizer("qwen2")
    if args.template == "qwen3-style":
        tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(args.conversations)))
        for num_proc in args.num_proc:
            best_wall = best_cpu = float("inf")
            for repeat in range(args.repeats):
                cfg = DataConfig(path=str(path), cache_dir=f"{tmp}/cache-{num_proc}-{repeat}", max_seq_len=4096,
                                 num_proc=num_proc)
                wall, cpu = time.perf_counter(), cpu_seconds()
                train, _ = load_sft_data(cfg, tokenizer, seed=0)
                best_wall = min(best_wall, time.perf_counter() - wall)
                best_cpu = min(best_cpu, cpu_seconds() - cpu)
            # The machine is shared: CPU seconds (this process + its workers) do not count time
            # spent waiting for a core, wall-clock does.
            print(f"num_proc={num_proc}: {args.conversations / best_wall:,.0f} conversations/s wall-clock "
                  f"({best_wall:.2f} s), {args.conversations / best_cpu:,.0f} per CPU-second ({best_cpu:.2f} s); "
                  f"kept {len(train)} rows of {args.conversations} conversations, {sum(train['length']):,} tokens",
                  flush=True)


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished children (datasets' workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

if __name__ == "__main__":
    main()
