"""Reward functions for GRPO, and the checks around calling them.

A reward function is named in the config as "module:function" (`grpo.reward_fns`, several
summed) and called as `fn(prompts: list[str], completions: list[str], **columns) ->
list[float]`, where `columns` are the prompt records' other JSONL fields, one list entry per
completion (e.g. `answer=[...]`). Every result is checked: a function that raises, returns the
wrong number of rewards or a non-finite one stops the run with one line naming it
(`RewardError`), before anything is trained on it.

Shipped, for tasks with a reference answer in an `answer` column:
  exact_match     1 if the completion's answer (the text of its last <answer>...</answer>, else
                  the whole completion, stripped) equals the reference, else 0.
  answer_format   1 if the completion holds exactly one <answer>...</answer> block, else 0.
  similarity      partial credit in [0, 1]: how much of the completion's answer matches the
                  reference, character by character (difflib's ratio, 2·matched / total length).
"""

from __future__ import annotations

import difflib
import importlib
import math
import re
from typing import Callable, Mapping, Sequence

import numpy as np

RewardFn = Callable[..., Sequence[float]]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class RewardError(ValueError):
  """A reward function failed or returned what cannot be trained on; the message is one line."""


def resolve(name: str) -> RewardFn:
  """The function named "module:function"; ValueError (one line) naming what is missing."""
  module_name, sep, fn_name = name.partition(":")
  if not sep or not module_name or not fn_name:
    raise ValueError(f"reward function {name!r}: name it as 'module:function', e.g. "
                     f"'jaxtrain.objectives.grpo.rewards:exact_match'")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    # A jaxtrain module that is not this one: point at where the built-in functions live.
    hint = (f"; jaxtrain's own reward functions are in {__name__}"
            if module_name.startswith("jaxtrain") and module_name != __name__ else "")
    raise ValueError(f"reward function {name!r}: cannot import {module_name!r} ({e}){hint}"
                     ) from None
  fn = getattr(module, fn_name, None)
  if not callable(fn):
    raise ValueError(f"reward function {name!r}: {module_name} has no function {fn_name!r}")
  return fn


def score(fns: Sequence[tuple[str, RewardFn]], prompts: Sequence[str],
          completions: Sequence[str], columns: Mapping[str, Sequence]) -> np.ndarray:
  """The summed rewards [len(completions)] of the named functions, each result checked."""
  total = np.zeros(len(completions), np.float64)
  for values in score_each(fns, prompts, completions, columns):
    total += values
  return total


def score_each(fns: Sequence[tuple[str, RewardFn]], prompts: Sequence[str],
               completions: Sequence[str], columns: Mapping[str, Sequence]) -> list[np.ndarray]:
  """Each named function's rewards (float64 [len(completions)]), each result checked."""
  n = len(completions)
  each = []
  for name, fn in fns:
    try:
      out = fn(list(prompts), list(completions), **{k: list(v) for k, v in columns.items()})
    except Exception as e:  # pylint: disable=broad-except  (any failure is the user's to see)
      raise RewardError(f"reward function {name} raised {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    try:
      values = [float(v) for v in out]
    except (TypeError, ValueError):
      raise RewardError(f"reward function {name} returned {type(out).__name__} "
                        f"{_short(out)}; it must return a list of {n} numbers") from None
    if len(values) != n:
      raise RewardError(f"reward function {name} returned {len(values)} rewards for {n} "
                        f"completions")
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
      raise RewardError(f"reward function {name} returned {values[bad]!r} for completion {bad} "
                        f"({_short(completions[bad])}); rewards must be finite")
    each.append(np.asarray(values, np.float64))
  return each


def _short(x, limit: int = 60) -> str:
  text = repr(x)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def extract_answer(completion: str) -> str:
  """The text of the completion's last <answer>...</answer> block, else the whole completion;
  stripped."""
  found = _ANSWER.findall(completion)
  return (found[-1] if found else completion).strip()


def exact_match(prompts, completions, *, answer, **columns) -> list[float]:
  """1.0 where the completion's answer equals the `answer` column (both stripped), else 0.0."""
  del prompts, columns
  return [float(extract_answer(c) == str(a).strip()) for c, a in zip(completions, answer)]


def answer_format(prompts, completions, **columns) -> list[float]:
  """1.0 where the completion holds exactly one <answer>...</answer> block, else 0.0."""
  del prompts, columns
  return [float(len(_ANSWER.findall(c)) == 1 and c.count("<answer>") == 1) for c in completions]


def similarity(prompts, completions, *, answer, **columns) -> list[float]:
  """2·M / (len(a) + len(r)) for the completion's answer a and the reference r, where M counts
  the characters of their longest matching blocks (difflib.SequenceMatcher.ratio): 1.0 for an
  exact match, partial credit for a near miss, so a weak model still gets a signal."""
  del prompts, columns
  return [difflib.SequenceMatcher(None, extract_answer(c), str(a).strip()).ratio()
          for c, a in zip(completions, answer)]
