"""python -m sft.data --config CONFIG [--show N] [--stats]: the data exactly as train.py loads it
(same config, same tokenisation and cache), with the trained tokens marked, and its statistics.
One process, no GPU."""

from __future__ import annotations

import argparse
import re
import sys

import numpy as np
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerBase

from sft.config import load_config
from sft.data.batches import pack_best_fit
from sft.data.images import image_tokens, shown
from sft.data.masking import IGNORE_INDEX
from sft.data.prepare import expansion, prepare_sft_data, reasoning
from sft.data.sources import SOURCE_ROW, where
from sft.errors import run_command
from sft.hub.tokenizer import load_tokenizer


def _marked(tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int], colour: bool,
            image_token: str | None = None) -> str:
    """The sample's text with its supervised spans in green (terminal) or between [[ and ]]; an
    image's placeholder tokens as one, with their number (`<|image_pad|>x256`)."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] == IGNORE_INDEX) != (labels[start] == IGNORE_INDEX):
            text = tokenizer.decode(ids[start:i])
            if labels[start] != IGNORE_INDEX:
                text = f"\033[32m{text}\033[0m" if colour else f"[[{text}]]"
            out.append(text)
            start = i
    text = "".join(out)
    if image_token:
        run = f"(?:{re.escape(image_token)})+"
        text = re.sub(run, lambda m: f"{image_token}x{len(m[0]) // len(image_token)}", text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sft.data",
        description="Load the data exactly as train.py does (same config, same tokenisation and cache), then show "
                    "samples with the trained tokens marked and statistics. Single process, no GPU.")
    parser.add_argument("--config", required=True, help="the YAML file you train with")
    parser.add_argument("--show", type=int, default=0, metavar="N", help="print the first N training samples")
    parser.add_argument("--stats", action="store_true", help="print statistics (the default without --show)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides as for train.py, e.g. data.max_seq_len=4096")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    tokenizer = load_tokenizer(cfg.model)
    images = image_tokens(cfg.model, tokenizer)
    train, evals, reports = prepare_sft_data(cfg.data, tokenizer, cfg.train.seed, images)

    colour = sys.stdout.isatty()
    for index in range(min(args.show, len(train))):
        row = train[index]
        expanded = (f", row {row['part'] + 1}/{row['parts']} of that conversation: assistant turn "
                    f"{', '.join(str(turn + 1) for turn in row['turns'])} of {row['assistant_turns']}"
                    if row["parts"] > 1 else "")
        print(f"--- sample {index} ({row['length']} tokens, {where(cfg.data.path, [row[SOURCE_ROW]])[row[SOURCE_ROW]]} "
              f"of {cfg.data.path}{expanded}; trained: {'green' if colour else '[[...]]'})")
        print(_marked(tokenizer, row["input_ids"], row["labels"], colour, images and images.token))
        if row["images"]:
            print(f"images: {', '.join(map(shown, row['images']))}")
    if args.stats or not args.show:
        for split, data in (("train", train), ("eval", evals)):
            if data is None:
                continue
            report = reports[split]
            lengths = np.sort(np.asarray(data["length"]))
            labels = pc.list_flatten(data.data.column("labels"))
            supervised = pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py()
            print(f"{split}: kept {len(data)}/{report.rows} rows")
            for reason, (count, at) in report.drops.items():
                print(f"  dropped {count}: {reason} (first: {at})")
            print(f"  tokens per sample: min {lengths[0]}, median {int(np.median(lengths))}, "
                  f"p99 {int(np.percentile(lengths, 99))}, max {lengths[-1]}; {lengths.sum():,} in all")
            print(f"  supervised: {supervised:,} tokens ({supervised / lengths.sum():.1%})")
            print(f"  cut by data.max_seq_len={cfg.data.max_seq_len}: {report.truncated} samples")
            if report.expanded:
                print(f"  expansion: {expansion(report, int(lengths.sum()))}")
            if report.reasoning_turns:
                print(f"  reasoning: {reasoning(report)}")
            if split == "train" and cfg.data.packing:
                rows = pack_best_fit(data["length"], cfg.data.max_seq_len)
                print(f"  packing: {len(rows)} rows of {cfg.data.max_seq_len}, "
                      f"fill {lengths.sum() / (len(rows) * cfg.data.max_seq_len):.1%}")


if __name__ == "__main__":
    run_command(main)
