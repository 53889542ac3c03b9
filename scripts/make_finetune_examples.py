"""Writes the small fine-tuning data sets the tiny SFT/LoRA/QLoRA/DPO configs train on.

  python scripts/make_finetune_examples.py
  # -> examples/finetune/{sft,preference}.jsonl and examples/grpo/reverse.jsonl

The task is reversing a word, which a byte-level model can learn in a few hundred CPU steps:
  sft.jsonl         {"prompt": "reverse: python\\n", "completion": "nohtyp"}
  preference.jsonl  {"prompt": ..., "chosen": the reversal, "rejected": a wrong answer (the word
                    copied, or reversed but in capitals)}
  reverse.jsonl     {"prompt": "reverse: python\n", "answer": "nohtyp"}: GRPO prompts, the
                    answer column read by the reward functions
Words are pronounceable letter strings from a seeded generator, so the files are the same on
every machine and the committed copies can be checked against a rerun.
"""

from __future__ import annotations

import json
import os
import random

EXAMPLES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "examples"))
OUT = os.path.join(EXAMPLES, "finetune")
CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiou"


def words(n: int, seed: int) -> list[str]:
  """`n` distinct pronounceable words of 3 to 9 letters."""
  rng, seen = random.Random(seed), []
  found = set()
  while len(seen) < n:
    length = rng.randint(3, 9)
    w = "".join(rng.choice(CONSONANTS if i % 2 == 0 else VOWELS) for i in range(length))
    if w not in found:
      found.add(w)
      seen.append(w)
  return seen


def sft_record(word: str) -> dict:
  return {"prompt": f"reverse: {word}\n", "completion": word[::-1]}


def preference_record(word: str, i: int) -> dict:
  # Two kinds of wrong answer, so the preference is about the reversal, not one surface cue.
  rejected = word if i % 2 == 0 else word[::-1].upper()
  return {"prompt": f"reverse: {word}\n", "chosen": word[::-1], "rejected": rejected}


def write(path: str, records) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  print(f"wrote {path}")


def main():
  os.makedirs(OUT, exist_ok=True)
  write(os.path.join(OUT, "sft.jsonl"), [sft_record(w) for w in words(3000, seed=1)])
  write(os.path.join(OUT, "preference.jsonl"),
        [preference_record(w, i) for i, w in enumerate(words(3000, seed=2))])
  os.makedirs(os.path.join(EXAMPLES, "grpo"), exist_ok=True)
  write(os.path.join(EXAMPLES, "grpo", "reverse.jsonl"),
        [{"prompt": f"reverse: {w}\n", "answer": w[::-1]} for w in words(3000, seed=3)])


if __name__ == "__main__":
  main()
