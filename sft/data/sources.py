"""Reading a dataset's rows: a local .jsonl / .json / .parquet file or a hub dataset, each row
numbered by its place in the file (so that a message can point at it), and its format from its
columns. A file that cannot be read is one DataError naming the line and the fix."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import datasets

from sft.config import DATA_FILE_SUFFIXES
from sft.errors import UserError

# Drop counts are logged by us; datasets' per-map progress bars only clutter Slurm logs.
datasets.disable_progress_bars()


class DataError(UserError):
    """The dataset cannot be used as configured; the message names the file/key and the fix."""


# Each row keeps its position in the file through shuffle and split, so a message can point at it.
SOURCE_ROW = "source_row"


def check_text(path: Path, source: str) -> None:
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


def load_rows(path: str, subset: str | None, split: str, cache_dir: str | None, key: str) -> datasets.Dataset:
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
            check_text(local, source)
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


def where(path: str, source_rows: list[int]) -> dict[int, str]:
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
                    f"(found: {', '.join(columns)}){bare}; see docs/data.md")
