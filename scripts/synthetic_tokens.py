"""Synthetic pre-tokenised data for benchmarks: random ids, loss on the second half of each sample.

    python scripts/synthetic_tokens.py --out data/bench/p7b.parquet --samples 512 --length 4096
    python scripts/synthetic_tokens.py --out data/bench/v7b.parquet --samples 4096 --lognormal 600 0.8
    python scripts/synthetic_tokens.py --out data/bench/tail128k.parquet --samples 100 --length 131072 \
        --min-length 1024 --lognormal 16384 1.0

Fixed length (workload P-7B) or lengths round(exp(N(ln median, sigma))) clipped to [min-length,
length] (workload V-7B: [64, 4096]; the long tail of issue #25: [1k, 128k]), as in
docs/BENCHMARKS.md, "Workloads".
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--lognormal", type=float, nargs=2, metavar=("MEDIAN", "SIGMA"))
    parser.add_argument("--min-length", type=int, default=64, help="shortest sample with --lognormal")
    parser.add_argument("--vocab", type=int, default=151_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    if args.lognormal:
        median, sigma = args.lognormal
        lengths = np.clip(np.round(np.exp(rng.normal(math.log(median), sigma, args.samples))), args.min_length,
                          args.length)
    else:
        lengths = np.full(args.samples, args.length)
    ids, labels = [], []
    for n in lengths.astype(int):
        row = rng.integers(0, args.vocab, n)
        target = row.copy()
        target[: n // 2] = -100
        ids.append(row)
        labels.append(target)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": ids, "labels": labels}), out)
    print(f"wrote {args.samples} samples (mean length {lengths.mean():.0f}) to {out}")


if __name__ == "__main__":
    main()
