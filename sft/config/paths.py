"""Where a name in the config points: a file or directory on this machine, or the Hugging Face hub."""

from __future__ import annotations

import os

DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def is_local_path(path: str) -> bool:
    """Whether `path` (a model, tokenizer, dataset or export) names something on this machine rather
    than the hub: it starts with / . or ~, names a data file, has more '/' than a hub id ('name' or
    'org/name'), or is a directory here (as transformers, which looks on disk first, reads
    `runs/base`). The one rule every loader and check asks."""
    return (path.startswith(("/", ".", "~")) or path.endswith(DATA_FILE_SUFFIXES) or path.count("/") > 1
            or os.path.isdir(path))
