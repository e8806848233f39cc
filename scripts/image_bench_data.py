"""The image benchmark's rows: one picture and about a thousand text tokens each (seeded; no network).

    python scripts/image_bench_data.py --out data/bench/images --rows 512 --size 448
    python scripts/image_bench_data.py --out data/bench/images_varlen --sigma 0.8   # replies of log-normal length

Each conversation asks about one SIZE x SIZE picture of a coloured shape (scripts/demo_data.py draws
it; 448 x 448 is 196 vision tokens for Qwen3.5's 16-pixel patches merged 2 x 2) and answers with
WORDS random words (~1,000 tokens of the demo tokenizer at the default), so that rows are one image
and a long reply, as in document and screenshot SFT. With --sigma S the replies' lengths are
log-normal (median WORDS, sigma S, 20 to 4 x WORDS words): chats of varied length, for packing.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from demo_data import WORDS, picture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/bench/images")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--words", type=int, default=450)
    parser.add_argument("--sigma", type=float, default=0.0)
    args = parser.parse_args()
    out, rng = Path(args.out), random.Random(0)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(args.rows):
        facts = picture(rng, out / "images" / f"{i}.png", args.size)
        words = min(4 * args.words, max(20, round(args.words * rng.lognormvariate(0, args.sigma))))
        reply = f"It is a {facts['colour']} {facts['shape']} on the {facts['side']}. " + " ".join(
            rng.choice(WORDS) for _ in range(words))
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"images/{i}.png"}},
                                         {"type": "text", "text": "Describe the picture in detail."}]},
            {"role": "assistant", "content": reply}]})
    tmp = out / "train.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out / "train.jsonl")  # never leave a half-written file behind
    print(f"wrote {args.rows} rows with {args.size} x {args.size} pictures to {out}")


if __name__ == "__main__":
    main()
