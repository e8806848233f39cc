"""A split tokenised and accounted for: rows loaded and shuffled, the eval split held out by
conversation, every row tokenised once (cached by `datasets` under a key of the tokenising code),
and a report of what was kept, dropped, cut, expanded and what carried reasoning."""

from __future__ import annotations

import inspect
import pickle
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import datasets
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from sft.config import DataConfig
from sft.data import images as image_code, masking, rows as tokenising
from sft.data.images import ImageTokens
from sft.data.rows import ROW_COLUMNS, TOKENIZED_FEATURES, tokenize_batch
from sft.data.sources import SOURCE_ROW, DataError, check_text, detect_format, load_rows, where
from sft.distributed import log0, rank0_first

# The code that decides the tokens: editing anything else (the sampler, the CLI) keeps the cache.
_TOKENISATION_SOURCE = inspect.getsource(tokenising) + inspect.getsource(masking) + inspect.getsource(image_code)



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
              source: str, split_name: str, images: ImageTokens | None = None
              ) -> tuple[datasets.Dataset, SplitReport]:
    fmt = detect_format(rows.column_names, source)
    kwargs = dict(tokenizer=tokenizer, fmt=fmt, max_seq_len=cfg.max_seq_len,
                  last_turn_only=cfg.train_on == "last_assistant", template_kwargs=cfg.chat_template_kwargs,
                  images=images, image_dir=str(image_directory(path)))

    # datasets keys its cache on the function's *name* for module-level functions, not its code:
    # put the source of the tokenisation code in the key so an upgrade never reuses stale rows.
    # The tokenizer goes in as its C pickle: hashing it through datasets' dill pickler takes ~5x as
    # long (seconds for a 151k vocabulary), and the C pickle is as complete and as deterministic.
    fingerprint = Hasher.hash([rows._fingerprint, _TOKENISATION_SOURCE, pickle.dumps(tokenizer),
                               {k: v for k, v in kwargs.items() if k not in ("tokenizer", "images")},
                               images and (images.processor.to_json_string(), images.token, images.token_id)])
    try:
        tokenized = rows.map(tokenize_batch, fn_kwargs=kwargs, batched=True, remove_columns=rows.column_names,
                             features=TOKENIZED_FEATURES, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                             new_fingerprint=fingerprint, desc=f"tokenising {split_name}")
    except UnicodeDecodeError as e:  # pyarrow keeps invalid UTF-8 until a row is read
        if Path(path).suffix in (".jsonl", ".json"):
            check_text(Path(path), source)
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
    lines = where(path, list(first.values()))
    report = _split_report(columns, {r: (n, lines[first[r]]) for r, n in counts.most_common()},
                           masking.reasoning_field(tokenizer))
    for reason, (count, at) in report.drops.items():
        log0(f"data: dropped {count}/{len(tokenized)} {split_name} samples: {reason} (first: {at} of {path})")
    if kept == 0:
        raise DataError(f"{source}: every {split_name} sample was dropped "
                        f"({'; '.join(f'{n}x {r}' for r, (n, _) in report.drops.items())}); nothing to "
                        f"{'train' if split_name == 'train' else 'evaluate'} on")
    if report.truncated:
        log0(f"data: data.max_seq_len={cfg.max_seq_len} cut {report.truncated}/{kept} {split_name} samples")
    if report.expanded:
        log0(f"data: {split_name}: {expansion(report, sum(columns['length']))} (docs/data.md: How masking works; "
             "data.train_on=last_assistant trains only each last turn, without expansion)")
    if report.reasoning_turns:
        log0(f"data: {split_name}: {reasoning(report)}")
    kept_rows = tokenized.filter(lambda r: r == "", input_columns="drop_reason")
    return kept_rows.remove_columns(["drop_reason", "cut"]), report


def image_directory(path: str) -> Path:
    """Where the relative image paths of the data at `path` start: its directory (a local file's, or
    a local directory of files), else the working directory (a hub dataset)."""
    local = Path(path)
    return (local if local.is_dir() else local.parent if local.is_file() else Path.cwd()).resolve()


def expansion(report: SplitReport, tokens: int) -> str:
    return (f"{report.expanded}/{report.conversations} conversations expanded to one row per turn group, as the "
            f"chat template rewrites history: +{report.expansion_rows} rows, +{report.expansion_tokens:,} tokens "
            f"({report.expansion_tokens / max(tokens, 1):.1%} of the tokens)")


def reasoning(report: SplitReport) -> str:
    return (f"{report.reasoning_turns}/{report.assistant_turns} assistant turns carry reasoning, passed to the chat "
            f"template {'as ' + report.reasoning_field if report.reasoning_field else 'inline in content'}")


def prepare_sft_data(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, images: ImageTokens | None = None
                     ) -> tuple[datasets.Dataset, datasets.Dataset | None, dict[str, SplitReport]]:
    """load_sft_data, plus what tokenising each split ('train', 'eval') dropped and cut."""
    rows = load_rows(cfg.path, cfg.subset, cfg.split, cfg.cache_dir, "data.path").shuffle(seed=seed)
    if cfg.max_samples is not None:
        rows = rows.select(range(min(cfg.max_samples, len(rows))))
    eval_rows, eval_path = None, cfg.eval_path or cfg.path
    if cfg.eval_path:
        eval_rows = load_rows(cfg.eval_path, cfg.subset, cfg.split, cfg.cache_dir, "data.eval_path")
    elif cfg.eval_fraction > 0:
        parts = rows.train_test_split(test_size=cfg.eval_fraction, seed=seed)
        rows, eval_rows = parts["train"], parts["test"]
    train, train_report = _tokenize(rows, tokenizer, cfg, cfg.path, f"data.path={cfg.path}", "train", images)
    if eval_rows is None:
        return train, None, {"train": train_report}
    source = f"data.eval_path={cfg.eval_path}" if cfg.eval_path else \
        f"data.eval_fraction={cfg.eval_fraction} of data.path={cfg.path}"
    evals, eval_report = _tokenize(eval_rows, tokenizer, cfg, eval_path, source, "eval", images)
    return train, evals, {"train": train_report, "eval": eval_report}


def load_sft_data(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, images: ImageTokens | None = None
                  ) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Return (train, eval or None) with columns input_ids, labels, length, images (their sources; the
    model's `images` tokens, None for a model that takes none) and ROW_COLUMNS (source_row: the
    conversation's position in its file; part, parts, turns: which of its rows this is)."""
    train, evals, _ = rank0_first(lambda: prepare_sft_data(cfg, tokenizer, seed, images))
    return train, evals
