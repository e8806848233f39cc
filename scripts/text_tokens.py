"""Byte-level language modelling rows from text files: a learnable task whose loss has a floor well
above zero, for comparing numerics (float8 against bf16) where a difference of 2% means something.

    python scripts/text_tokens.py --out data/float8num            # train.parquet + eval.parquet

The default corpus is this Python's standard library source (~30 MB of .py files on every machine,
no download). Token ids are the bytes (0-255) and FILE_SEPARATOR between files; the files are
concatenated in path order and cut into rows of `--length` tokens, every token supervised. Every
`--eval-every`-th file (by path) is held out, so the eval loss measures generalisation, not recall.
A task whose answers are deterministic (the demo chats) drives the loss towards zero, where runs
that differ only in their seed land tens of percent apart.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FILE_SEPARATOR = 256  # a token no byte produces; the model's vocabulary must exceed it


def rows_of(files: list[Path], length: int) -> np.ndarray:
    pieces = []
    for path in files:
        pieces += [np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32), np.array([FILE_SEPARATOR])]
    stream = np.concatenate(pieces)
    return stream[: len(stream) // length * length].reshape(-1, length)


def write(rows: np.ndarray, out: Path) -> None:
    ids = [row.tolist() for row in rows]
    pq.write_table(pa.table({"input_ids": ids, "labels": ids}), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder for train.parquet and eval.parquet")
    parser.add_argument("--source", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="folder of text files (default: the Python standard library)")
    parser.add_argument("--glob", default="*.py")
    parser.add_argument("--length", type=int, default=512, help="tokens per row")
    parser.add_argument("--eval-every", type=int, default=20, help="hold out every N-th file")
    parser.add_argument("--eval-rows", type=int, default=256)
    args = parser.parse_args()
    files = sorted(p for p in args.source.rglob(args.glob) if p.is_file() and "site-packages" not in p.parts)
    if not files:
        raise SystemExit(f"no {args.glob} files under {args.source}")
    held_out = set(files[:: args.eval_every])
    train = rows_of([f for f in files if f not in held_out], args.length)
    evaluation = rows_of(sorted(held_out), args.length)[: args.eval_rows]
    args.out.mkdir(parents=True, exist_ok=True)
    write(train, args.out / "train.parquet")
    write(evaluation, args.out / "eval.parquet")
    print(f"{len(files)} files under {args.source}: {len(train)} training rows and {len(evaluation)} held-out rows "
          f"of {args.length} byte tokens in {args.out}")


if __name__ == "__main__":
    main()
