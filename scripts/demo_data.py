"""Generate the demo's synthetic multi-turn chat data (seeded; no network).

    python scripts/demo_data.py --out data/demo          # train.jsonl + eval.jsonl
    python scripts/demo_data.py --images --out data/demo_vlm   # + images/: questions about pictures

Tasks a tiny model can learn in minutes on a CPU: two-digit arithmetic, unit conversion,
spelling and reversing words; one to three turns, with or without a system prompt. With --images:
a shape of one colour on the left or the right of a small picture, and questions about its
colour, shape and side (the picture in the first user turn, as an OpenAI image part).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("apple banana cherry garden window river mountain pencil rocket planet silver orange yellow "
         "purple violet castle dragon forest island jungle kitten lemon mango needle ocean pepper "
         "quartz rabbit sunset tiger umbrella valley walnut zebra anchor bridge candle desert engine "
         "falcon guitar harbor insect jacket kettle ladder magnet napkin oyster parrot puzzle "
         "saddle tunnel velvet wagon yogurt basket cactus dolphin feather glacier hammer igloo "
         "jigsaw koala lantern marble nectar orchid pillow quiver ribbon spider turtle").split()
UNITS = (("km", "meters", 1000), ("m", "centimeters", 100), ("kg", "grams", 1000),
         ("hours", "minutes", 60), ("minutes", "seconds", 60), ("liters", "milliliters", 1000))
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a careful tutor. Answer briefly.",
                  "Answer every question exactly.")


def _arithmetic(rng: random.Random, follow_up: bool) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op = rng.choice("+-")
    result = a + b if op == "+" else a - b
    question = f"And what is {a} {op} {b}?" if follow_up else rng.choice(
        (f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"Please calculate {a} {op} {b}."))
    return question, f"{a} {op} {b} = {result}."


def _conversion(rng: random.Random, follow_up: bool) -> tuple[str, str]:
    src, dst, factor = rng.choice(UNITS)
    n = rng.randint(2, 12)
    question = f"And {n} {src}?" if follow_up else rng.choice(
        (f"Convert {n} {src} to {dst}.", f"How many {dst} are in {n} {src}?"))
    return question, f"{n} {src} is {n * factor} {dst}."


def _spelling(rng: random.Random, follow_up: bool) -> tuple[str, str]:
    word = rng.choice(WORDS)
    question = f"Now spell '{word}'." if follow_up else f"Spell the word '{word}'."
    return question, f"{word} is spelled {'-'.join(word)}."


def _reverse(rng: random.Random, follow_up: bool) -> tuple[str, str]:
    word = rng.choice(WORDS)
    question = f"Now reverse '{word}'." if follow_up else f"Reverse the word '{word}'."
    return question, f"'{word}' reversed is '{word[::-1]}'."


TASKS = (_arithmetic, _conversion, _spelling, _reverse)


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    task = rng.choice(TASKS)
    for turn in range(rng.randint(1, 3)):
        question, answer = task(rng, follow_up=turn > 0)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def generate(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("square", "circle", "triangle")
PICTURE_QUESTIONS = (("What colour is the shape?", "It is {colour}."), ("What shape is it?", "It is a {shape}."),
                     ("Where is the shape?", "It is on the {side}."))


def picture(rng: random.Random, path: Path, size: int = 96) -> dict[str, str]:
    """Draw one shape on a white picture at `path`; its colour, shape and side."""
    from PIL import Image, ImageDraw

    facts = {"colour": rng.choice(list(COLOURS)), "shape": rng.choice(SHAPES), "side": rng.choice(("left", "right"))}
    image = Image.new("RGB", (size, size), "white")
    half, r = size // 2, size // 5
    x = rng.randint(r, half - r) + (half if facts["side"] == "right" else 0)
    y = rng.randint(r, size - r)
    box, colour = (x - r, y - r, x + r, y + r), COLOURS[facts["colour"]]
    draw = ImageDraw.Draw(image)
    if facts["shape"] == "square":
        draw.rectangle(box, fill=colour)
    elif facts["shape"] == "circle":
        draw.ellipse(box, fill=colour)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    image.save(path)
    return facts


def picture_conversations(n: int, seed: int, out: Path, prefix: str) -> list[dict]:
    """`n` conversations about pictures written to out/images/ (paths relative to `out`)."""
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        relative = f"images/{prefix}{i}.png"
        facts = picture(rng, out / relative)
        asked = rng.sample(PICTURE_QUESTIONS, rng.randint(1, 2))
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": relative}},
                                                 {"type": "text", "text": asked[0][0]}]},
                    {"role": "assistant", "content": asked[0][1].format(**facts)}]
        for question, answer in asked[1:]:
            messages += [{"role": "user", "content": [{"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer.format(**facts)}]
        rows.append({"messages": messages})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/demo")
    parser.add_argument("--train", type=int, default=1200)
    parser.add_argument("--eval", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", action="store_true", help="questions about pictures (written to OUT/images/)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.images:
        splits = (("train", picture_conversations(args.train, args.seed, out, "train")),
                  ("eval", picture_conversations(args.eval, args.seed + 1, out, "eval")))
    else:
        splits = (("train", generate(args.train, args.seed)), ("eval", generate(args.eval, args.seed + 1)))
    for name, rows in splits:
        tmp = out / f"{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(out / f"{name}.jsonl")  # never leave a half-written file behind
    print(f"wrote {args.train} train and {args.eval} eval conversations to {out}")


if __name__ == "__main__":
    main()
