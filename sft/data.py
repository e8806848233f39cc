"""Chat data: load rows with `datasets`, normalise the three formats, tokenise with labels, batch.

Formats (detected from the columns):
* OpenAI `messages`: [{role, content, tool_calls?}], roles system/user/assistant/tool, optional
  `tools` column (list of JSON schemas, or a JSON string of one).
* ShareGPT `conversations`: [{from, value}] with from in system/human/gpt/tool (and the aliases
  below).
* `prompt` / `completion`: strings (one user turn, one assistant turn), or lists of messages.
* `input_ids` / `labels`: already tokenised (labels unshifted, -100 = not trained), used as is
  (benchmarks, or data prepared elsewhere).

A conversation becomes one training row, or several when its chat template rewrites history
(sft/masking.py); the rows keep their conversation's file row, and shuffling, `max_samples` and the
eval split act on conversations before tokenisation, so a conversation's rows stay on one side.

Tokenisation runs through `datasets.map`, so it is cached on disk and a rerun starts at once.
Rank 0 loads and tokenises first (so bad data is one error, reported once); the other ranks then
read its cache.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import pickle
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
import torch
from transformers import PreTrainedTokenizerBase

from sft.config import DATA_FILE_SUFFIXES, ConfigError, DataConfig, load_config
from sft.errors import UserError, run_command
from sft.distributed import log0, rank0_first
from sft import masking
from sft.collate import collate, collate_packed
from sft.model import load_tokenizer
from sft.masking import IGNORE_INDEX, DropSample, RowPlan, encode_segments, render_rows, truncate_tokenized

# Drop counts are logged by us; datasets' per-map progress bars only clutter Slurm logs.
datasets.disable_progress_bars()

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool", "function_call": "assistant",
                  "observation": "tool", "function": "tool"}


class DataError(UserError):
    """The dataset cannot be used as configured; the message names the file/key and the fix."""


# Each row keeps its position in the file through shuffle and split, so a message can point at it.
SOURCE_ROW = "source_row"


def _check_text(path: Path, source: str) -> None:
    """After `datasets` failed to read a JSON or JSONL file: raise a DataError naming the first line
    that is not UTF-8 text, or (JSONL) not one JSON object, if any."""
    nonblank = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{source}: line {number} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8") from None
            if path.suffix != ".jsonl" or not line.strip():
                continue
            nonblank += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{source}: line {number} is not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise DataError(f"{source}: line {number} is a JSON {type(row).__name__}, "
                                "expected one object per line like {\"messages\": [...]}")
    if nonblank == 0 and path.suffix == ".jsonl":
        raise DataError(f"{source}: the dataset is empty (only blank lines)")


def _load_rows(path: str, subset: str | None, split: str, cache_dir: str | None, key: str) -> datasets.Dataset:
    local, source = Path(path), f"{key}={path!r}"
    try:
        if local.suffix in DATA_FILE_SUFFIXES:
            if not local.is_file():
                raise DataError(f"{source}: file not found")
            if local.stat().st_size == 0:
                raise DataError(f"{source}: the dataset is empty")
            builder = "parquet" if local.suffix == ".parquet" else "json"
            with _datasets_errors_unlogged():
                rows = datasets.load_dataset(builder, data_files=str(local), split="train", cache_dir=cache_dir)
        else:
            with _datasets_errors_unlogged():
                rows = datasets.load_dataset(path, subset, split=split, cache_dir=cache_dir)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (hub, parsing, missing split)
        if local.suffix in (".jsonl", ".json"):  # its messages do not say which line, or why; find it
            _check_text(local, source)
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        raise DataError(f"{source}: could not load the dataset: {type(e).__name__}: {e}{cause}") from None
    if len(rows) == 0:
        raise DataError(f"{source}: the dataset is empty")
    return rows.add_column(SOURCE_ROW, list(range(len(rows))))


@contextlib.contextmanager
def _datasets_errors_unlogged():
    """datasets logs its own error before raising it ("... in row 20", counted from 0), beside ours,
    which names the line (counted from 1) and the fix: the user gets ours alone."""
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)


def _where(path: str, source_rows: list[int]) -> dict[int, str]:
    """Where each row is in the user's file: 'line N' (1-based) of a JSONL file, else 'row N' (0-based)."""
    if Path(path).suffix != ".jsonl":
        return {row: f"row {row}" for row in source_rows}
    # datasets skips blank lines, so the n-th row is the n-th non-blank line.
    wanted, found, nonblank = set(source_rows), {}, -1
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                nonblank += 1
                if nonblank in wanted:
                    found[nonblank] = f"line {number}"
                    if len(found) == len(wanted):
                        break
    return found


def detect_format(columns: list[str], source: str) -> str:
    for fmt, needed in (("messages", {"messages"}), ("conversations", {"conversations"}),
                        ("prompt_completion", {"prompt", "completion"}), ("tokenized", {"input_ids", "labels"})):
        if needed <= set(columns):
            return fmt
    columns = [c for c in columns if c != SOURCE_ROW]
    # A line that is a bare list of messages reaches us as one row per message.
    bare = "; each line looks like a bare list of messages: write {\"messages\": [...]}" if {"role", "content"} <= set(
        columns) else ""
    raise DataError(f"{source}: no 'messages', 'conversations', 'prompt'+'completion' or 'input_ids'+'labels' column "
                    f"(found: {', '.join(columns)}){bare}; see README 'Data formats'")


def _drop_nulls(value: Any) -> Any:
    # Arrow unifies the keys of all rows' structs and fills the missing ones with None;
    # the chat template must see each message as it was written.
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def to_messages(row: dict, fmt: str) -> tuple[list[dict], list | None]:
    """One row -> (OpenAI-style messages, tools). Raises DropSample on malformed rows."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError:
            raise DropSample("the tools column is not valid JSON") from None
    if fmt == "messages":
        messages = row["messages"]
    elif fmt == "conversations":
        messages = []
        for turn in row["conversations"] or []:
            if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
                raise DropSample(f"unknown ShareGPT role {turn.get('from') if isinstance(turn, dict) else turn!r}")
            messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")})
    else:
        prompt, completion = row["prompt"], row["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise DropSample("prompt/completion must be strings or lists of messages")
        messages = prompt + completion
    return _drop_nulls(messages), _drop_nulls(tools) if tools else None


ROW_COLUMNS = (SOURCE_ROW, "part", "parts", "turns", "assistant_turns", "reasoning_turns")
_TOKENIZED_FEATURES = datasets.Features({
    **{name: datasets.List(datasets.Value("int64")) for name in ("input_ids", "labels", "turns")},
    **{name: datasets.Value("int64") for name in ("length", "cut", SOURCE_ROW, "part", "parts", "assistant_turns",
                                                  "reasoning_turns")},
    "drop_reason": datasets.Value("string")})
"""Declared, not inferred: a batch whose rows are all dropped has only empty lists, which Arrow
would type as lists of nulls that the next batch's token ids cannot be cast to."""
"""Where a training row comes from: its conversation's file row, its place among that conversation's
rows (part of parts: several when the chat template rewrites history), the assistant turns it trains
(counted from 0), and the conversation's numbers of assistant turns and of turns carrying reasoning."""


def _tokenize_batch(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, fmt: str, max_seq_len: int,
                    last_turn_only: bool, template_kwargs: dict) -> dict[str, list]:
    """A batch of conversations -> their training rows: input_ids, labels, length, tokens cut by
    truncation, drop_reason ('' = kept) and ROW_COLUMNS. A dropped conversation is one row with its
    reason and no tokens. Conversations are rendered one by one, then all segments of all their rows
    are tokenised in one call."""
    origins: list[tuple] = []  # ROW_COLUMNS of each output row
    contents: list[RowPlan | tuple[list[int], list[int]] | str] = []  # to tokenise, tokenised, or a drop reason
    for i, source_row in enumerate(batch[SOURCE_ROW]):
        try:
            if fmt == "tokenized":
                contents.append((batch["input_ids"][i], batch["labels"][i]))
                origins.append((source_row, 0, 1, [], 0, 0))
                continue
            messages, tools = to_messages({column: values[i] for column, values in batch.items()}, fmt)
            plans, reasoning_turns = render_rows(tokenizer, messages, tools, last_turn_only, template_kwargs)
        except DropSample as e:
            contents.append(str(e))
            origins.append((source_row, 0, 1, [], 0, 0))
            continue
        assistant_turns = sum(m["role"] == "assistant" for m in messages)
        for part, plan in enumerate(plans):
            contents.append(plan)
            origins.append((source_row, part, len(plans), list(plan.turns), assistant_turns, reasoning_turns))
    encoded = iter(encode_segments(tokenizer, [c.segments for c in contents if isinstance(c, RowPlan)]))
    out: dict[str, list] = {name: [] for name in ("input_ids", "labels", "length", "cut", "drop_reason", *ROW_COLUMNS)}
    for origin, content in zip(origins, contents):
        ids, labels, cut, reason = [], [], 0, content if isinstance(content, str) else ""
        if not reason:
            pair = next(encoded) if isinstance(content, RowPlan) else content
            try:
                ids, labels = truncate_tokenized(*pair, max_seq_len)
                cut = len(pair[0]) - len(ids)
            except DropSample as e:
                reason = str(e)
        for name, value in zip(("input_ids", "labels", "length", "cut", "drop_reason", *ROW_COLUMNS),
                               (ids, labels, len(ids), cut, reason, *origin)):
            out[name].append(value)
    return out


_TOKENISATION_SOURCE = inspect.getsource(sys.modules[__name__]) + inspect.getsource(masking)


@dataclass
class SplitReport:
    """What tokenising one split kept, dropped, cut and expanded."""

    rows: int
    """training rows before drops (a dropped conversation counts as one)"""
    drops: dict[str, tuple[int, str]]
    """reason -> (rows dropped for it, where the first of them is in the file, e.g. 'line 7')"""
    truncated: int
    """kept samples that data.max_seq_len cut"""
    conversations: int
    expanded: int
    """conversations given more than one row (their chat template rewrites history)"""
    expansion_rows: int
    """rows beyond one per conversation"""
    expansion_tokens: int
    """kept tokens the extra rows add: an expanded conversation's tokens minus those of its longest row"""
    assistant_turns: int
    reasoning_turns: int
    """assistant turns that carry reasoning (any field or inline <think>)"""
    reasoning_field: str | None
    """where the chat template reads reasoning from (None: inline in content)"""


def _split_report(columns: dict[str, list], drops: dict[str, tuple[int, str]], reasoning_in: str | None
                  ) -> SplitReport:
    """The report of one split from the tokenised columns (kept and dropped rows alike)."""
    firsts = [i for i, part in enumerate(columns["part"]) if part == 0]  # one row per conversation
    per_conversation: dict[int, list[int]] = {}
    for source_row, parts, length in zip(columns[SOURCE_ROW], columns["parts"], columns["length"]):
        if parts > 1:
            per_conversation.setdefault(source_row, []).append(length)
    return SplitReport(
        rows=len(columns["part"]), drops=drops, truncated=sum(cut > 0 for cut in columns["cut"]),
        conversations=len(firsts), expanded=len(per_conversation),
        expansion_rows=sum(len(lengths) - 1 for lengths in per_conversation.values()),
        expansion_tokens=sum(sum(lengths) - max(lengths) for lengths in per_conversation.values()),
        assistant_turns=sum(columns["assistant_turns"][i] for i in firsts),
        reasoning_turns=sum(columns["reasoning_turns"][i] for i in firsts), reasoning_field=reasoning_in)


def _tokenize(rows: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, path: str,
              source: str, split_name: str) -> tuple[datasets.Dataset, SplitReport]:
    fmt = detect_format(rows.column_names, source)
    kwargs = dict(tokenizer=tokenizer, fmt=fmt, max_seq_len=cfg.max_seq_len,
                  last_turn_only=cfg.train_on == "last_assistant", template_kwargs=cfg.chat_template_kwargs)

    # datasets keys its cache on the function's *name* for module-level functions, not its code:
    # put the source of the tokenisation code in the key so an upgrade never reuses stale rows.
    # The tokenizer goes in as its C pickle: hashing it through datasets' dill pickler takes ~5x as
    # long (seconds for a 151k vocabulary), and the C pickle is as complete and as deterministic.
    fingerprint = Hasher.hash([rows._fingerprint, _TOKENISATION_SOURCE, pickle.dumps(tokenizer),
                               {k: v for k, v in kwargs.items() if k != "tokenizer"}])
    try:
        tokenized = rows.map(_tokenize_batch, fn_kwargs=kwargs, batched=True, remove_columns=rows.column_names,
                             features=_TOKENIZED_FEATURES, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                             new_fingerprint=fingerprint, desc=f"tokenising {split_name}")
    except UnicodeDecodeError as e:  # pyarrow keeps invalid UTF-8 until a row is read
        if Path(path).suffix in (".jsonl", ".json"):
            _check_text(Path(path), source)
        raise DataError(f"{source}: not UTF-8 text ({e.reason}: byte 0x{e.object[e.start]:02x}); convert the file "
                        "to UTF-8, e.g. iconv -f latin1 -t utf-8") from None

    columns = tokenized.select_columns(  # read once
        ["drop_reason", "cut", "length", *ROW_COLUMNS]).to_dict()
    first: dict[str, int] = {}  # reason -> the first row in the file dropped for it (rows come shuffled)
    for reason, row in zip(columns["drop_reason"], columns[SOURCE_ROW]):
        if reason:
            first[reason] = min(first.get(reason, row), row)
    counts = Counter(columns["drop_reason"])
    kept = counts.pop("", 0)
    where = _where(path, list(first.values()))
    report = _split_report(columns, {r: (n, where[first[r]]) for r, n in counts.most_common()},
                           masking.reasoning_field(tokenizer))
    for reason, (count, at) in report.drops.items():
        log0(f"data: dropped {count}/{len(tokenized)} {split_name} samples: {reason} (first: {at} of {path})")
    if kept == 0:
        raise DataError(f"{source}: every {split_name} sample was dropped "
                        f"({'; '.join(f'{n}x {r}' for r, (n, _) in report.drops.items())}); nothing to train on")
    if report.truncated:
        log0(f"data: data.max_seq_len={cfg.max_seq_len} cut {report.truncated}/{kept} {split_name} samples")
    if report.expanded:
        log0(f"data: {split_name}: {_expansion(report, sum(columns['length']))} (README: How masking works; "
             "data.train_on=last_assistant trains only each last turn, without expansion)")
    if report.reasoning_turns:
        log0(f"data: {split_name}: {_reasoning(report)}")
    kept_rows = tokenized.filter(lambda r: r == "", input_columns="drop_reason")
    return kept_rows.remove_columns(["drop_reason", "cut"]), report


def _expansion(report: SplitReport, tokens: int) -> str:
    return (f"{report.expanded}/{report.conversations} conversations expanded to one row per turn group, as the "
            f"chat template rewrites history: +{report.expansion_rows} rows, +{report.expansion_tokens:,} tokens "
            f"({report.expansion_tokens / max(tokens, 1):.1%} of the tokens)")


def _reasoning(report: SplitReport) -> str:
    return (f"{report.reasoning_turns}/{report.assistant_turns} assistant turns carry reasoning, passed to the chat "
            f"template {'as ' + report.reasoning_field if report.reasoning_field else 'inline in content'}")


def prepare_sft_data(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
                     ) -> tuple[datasets.Dataset, datasets.Dataset | None, dict[str, SplitReport]]:
    """load_sft_data, plus what tokenising each split ('train', 'eval') dropped and cut."""
    rows = _load_rows(cfg.path, cfg.subset, cfg.split, cfg.cache_dir, "data.path").shuffle(seed=seed)
    if cfg.max_samples is not None:
        rows = rows.select(range(min(cfg.max_samples, len(rows))))
    eval_rows, eval_path = None, cfg.eval_path or cfg.path
    if cfg.eval_path:
        eval_rows = _load_rows(cfg.eval_path, cfg.subset, cfg.split, cfg.cache_dir, "data.eval_path")
    elif cfg.eval_fraction > 0:
        parts = rows.train_test_split(test_size=cfg.eval_fraction, seed=seed)
        rows, eval_rows = parts["train"], parts["test"]
    train, train_report = _tokenize(rows, tokenizer, cfg, cfg.path, f"data.path={cfg.path}", "train")
    if eval_rows is None:
        return train, None, {"train": train_report}
    evals, eval_report = _tokenize(eval_rows, tokenizer, cfg, eval_path, f"data.eval={eval_path}", "eval")
    return train, evals, {"train": train_report, "eval": eval_report}


def load_sft_data(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
                  seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Return (train, eval or None) with columns input_ids, labels, length and ROW_COLUMNS (source_row:
    the conversation's position in its file; part, parts, turns: which of its rows this is)."""
    train, evals, _ = rank0_first(lambda: prepare_sft_data(cfg, tokenizer, seed))
    return train, evals


def pack_best_fit(lengths: list[int], row_len: int) -> list[list[int]]:
    """Group sample indices into rows of at most `row_len` tokens, best-fit decreasing: longest
    first, each into the open row with the least room that still fits it."""
    rows: list[list[int]] = []
    by_room: list[list[int]] = [[] for _ in range(row_len + 1)]  # room left -> rows with that room
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[index]
        room = next((r for r in range(n, row_len + 1) if by_room[r]), None)
        if room is None:
            rows.append([])
            row, room = len(rows) - 1, row_len
        else:
            row = by_room[room].pop()
        rows[row].append(index)
        by_room[room - n].append(row)
    return rows


@functools.lru_cache(maxsize=2)
def _epoch_order(num_samples: int, seed: int) -> torch.Tensor:
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class StepSampler:
    """Which samples each rank trains on at each optimizer step: a pure function of the step.

    Each epoch is a seeded permutation of the training set cut into global batches of
    micro_batch_size x grad_accum_steps x world_size samples (the incomplete tail is dropped);
    rank r takes its contiguous share and splits it into grad_accum_steps micro-batches. Because
    the order depends only on (seed, step, global batch), resuming needs only the step number,
    and a resumed run on another number of ranks with the same global batch sees the same samples.
    """

    num_samples: int
    micro_batch_size: int
    grad_accum_steps: int
    rank: int
    world_size: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def micro_batches(self, step: int) -> list[list[int]]:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = _epoch_order(self.num_samples, self.seed + epoch)
        per_rank = self.micro_batch_size * self.grad_accum_steps
        start = k * self.global_batch + self.rank * per_rank
        mine = order[start : start + per_rank].tolist()
        return [mine[i : i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]


class MicroBatches:
    """Builds collated micro-batches from sampler indices: samples padded per micro-batch, or with
    `packed_rows`, indices of packed rows whose samples are laid end to end."""

    def __init__(self, dataset: datasets.Dataset, pad_token_id: int, cfg: DataConfig,
                 packed_rows: list[list[int]] | None = None):
        self.dataset, self.pad_token_id, self.cfg, self.packed_rows = dataset, pad_token_id, cfg, packed_rows

    def _samples(self, indices: list[int]) -> list[dict]:
        rows = self.dataset[indices]
        return [{"input_ids": i, "labels": lab} for i, lab in zip(rows["input_ids"], rows["labels"])]

    def __call__(self, indices: list[int]) -> tuple[dict[str, torch.Tensor], int]:
        """The micro-batch and its number of real (non-pad) tokens."""
        if self.packed_rows is None:
            samples = self._samples(indices)
            batch = collate(samples, self.pad_token_id, self.cfg.max_seq_len, self.cfg.pad_to_multiple_of,
                            pad_to_max=self.cfg.pad_to == "max_seq_len")
            return batch, sum(len(s["input_ids"]) for s in samples)
        groups = [self.packed_rows[i] for i in indices]
        samples = iter(self._samples([i for group in groups for i in group]))
        rows = [[next(samples) for _ in group] for group in groups]
        tokens = sum(len(s["input_ids"]) for row in rows for s in row)
        return collate_packed(rows, self.pad_token_id, self.cfg.max_seq_len), tokens


class TrainBatches:
    """This rank's micro-batches for each optimizer step. With data.packing the sampler draws
    packed rows (best-fit decreasing over the training set) instead of single samples."""

    def __init__(self, dataset: datasets.Dataset, pad_token_id: int, cfg: DataConfig, micro_batch_size: int,
                 grad_accum_steps: int, rank: int, world_size: int, seed: int):
        self.packed_rows = pack_best_fit(dataset["length"], cfg.max_seq_len) if cfg.packing else None
        self.sampler = StepSampler(len(self.packed_rows) if self.packed_rows else len(dataset), micro_batch_size,
                                   grad_accum_steps, rank, world_size, seed)
        if self.sampler.steps_per_epoch == 0:
            raise ConfigError(f"{self.sampler.num_samples} training {'rows' if self.packed_rows else 'samples'} < "
                              f"one global batch of {self.sampler.global_batch}; lower train.micro_batch_size or "
                              "train.grad_accum_steps")
        self.batches = MicroBatches(dataset, pad_token_id, cfg, self.packed_rows)
        self.num_samples = len(dataset)

    def step(self, step: int) -> list[tuple[dict[str, torch.Tensor], int]]:
        """(micro-batch, real tokens) pairs of optimizer step `step` (1-based)."""
        return [self.batches(indices) for indices in self.sampler.micro_batches(step - 1)]

    def describe(self) -> str:
        packed = f", packed into {len(self.packed_rows)} rows" if self.packed_rows else ""
        return f"{self.num_samples} train samples{packed}, global batch {self.sampler.global_batch}"


def _marked(tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int], colour: bool) -> str:
    """The sample's text with its supervised spans in green (terminal) or between [[ and ]]."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] == IGNORE_INDEX) != (labels[start] == IGNORE_INDEX):
            text = tokenizer.decode(ids[start:i])
            if labels[start] != IGNORE_INDEX:
                text = f"\033[32m{text}\033[0m" if colour else f"[[{text}]]"
            out.append(text)
            start = i
    return "".join(out)


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
    train, evals, reports = prepare_sft_data(cfg.data, tokenizer, cfg.train.seed)

    colour = sys.stdout.isatty()
    for index in range(min(args.show, len(train))):
        row = train[index]
        expanded = (f", row {row['part'] + 1}/{row['parts']} of that conversation: assistant turn "
                    f"{', '.join(str(turn + 1) for turn in row['turns'])} of {row['assistant_turns']}"
                    if row["parts"] > 1 else "")
        print(f"--- sample {index} ({row['length']} tokens, {_where(cfg.data.path, [row[SOURCE_ROW]])[row[SOURCE_ROW]]} "
              f"of {cfg.data.path}{expanded}; trained: {'green' if colour else '[[...]]'})")
        print(_marked(tokenizer, row["input_ids"], row["labels"], colour))
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
                print(f"  expansion: {_expansion(report, int(lengths.sum()))}")
            if report.reasoning_turns:
                print(f"  reasoning: {_reasoning(report)}")
            if split == "train" and cfg.data.packing:
                rows = pack_best_fit(data["length"], cfg.data.max_seq_len)
                print(f"  packing: {len(rows)} rows of {cfg.data.max_seq_len}, "
                      f"fill {lengths.sum() / (len(rows) * cfg.data.max_seq_len):.1%}")


if __name__ == "__main__":
    # Run the CLI from the importable module rather than this __main__ copy of it, so that every
    # function, the datasets cache key and the DataError class caught here are those train.py uses.
    import sft.data

    run_command(sft.data.main)
