"""Write the shipped demo instruction set apt_ds/io/assets/demo.jsonl (deterministic).

Five tiny tasks with short inputs, in the Alpaca instruction/input/output format. They are
chosen so a tiny random LLaMA visibly learns within ~60 steps: the answers are short and
follow from the input by copying, reordering or a keyword, so the loss drops fast and a
pruned model's quality is measurable without any pretrained weights.

    python benchmarks/make_demo_data.py            # rewrites apt_ds/io/assets/demo.jsonl
    python benchmarks/make_demo_data.py --out x.jsonl --count 300
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "apple river stone cloud green happy quick lamp music paper smile storm table tiger "
    "water yellow bread chair dream field glass heart light money night ocean plant "
    "quiet road small train voice winter bird clock door fire hill king moon rain sun tree"
).split()
GOOD = "great wonderful lovely excellent delightful fun charming superb".split()
BAD = "terrible awful boring dreadful dull painful bad horrible".split()
SUBJECTS = "the movie|the meal|this book|the hotel|our trip|the concert|that show|the game".split("|")


def reverse_words(rng: random.Random) -> dict:
    words = rng.sample(WORDS, rng.randint(3, 4))
    return {"instruction": "Reverse the words.", "input": " ".join(words), "output": " ".join(reversed(words))}


def sort_letters(rng: random.Random) -> dict:
    letters = rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(4, 6))
    return {"instruction": "Sort the letters.", "input": "".join(letters), "output": "".join(sorted(letters))}


def add_numbers(rng: random.Random) -> dict:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return {"instruction": "Add the numbers.", "input": f"{a} + {b}", "output": str(a + b)}


def capitalize(rng: random.Random) -> dict:
    phrase = " ".join(rng.sample(WORDS, rng.randint(2, 3)))
    return {"instruction": "Capitalize the text.", "input": phrase, "output": phrase.upper()}


def sentiment(rng: random.Random) -> dict:
    positive = rng.random() < 0.5
    adjective = rng.choice(GOOD if positive else BAD)
    sentence = f"{rng.choice(SUBJECTS)} was {adjective}."
    return {
        "instruction": "What is the sentiment?",
        "input": sentence[0].upper() + sentence[1:],
        "output": "positive" if positive else "negative",
    }


TASKS = (reverse_words, sort_letters, add_numbers, capitalize, sentiment)


def make_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    # Round-robin over tasks keeps them balanced in any prefix of the file.
    return [TASKS[i % len(TASKS)](rng) for i in range(count)]


def main() -> None:
    default_out = Path(__file__).resolve().parents[1] / "apt_ds" / "io" / "assets" / "demo.jsonl"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--count", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(record, ensure_ascii=False) for record in make_records(args.count, args.seed)]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} records ({args.out.stat().st_size / 1024:.0f} KiB) to {args.out}")


if __name__ == "__main__":
    main()
