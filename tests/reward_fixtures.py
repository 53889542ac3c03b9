"""Reward functions for the GRPO CLI tests, named as "tests.reward_fixtures:NAME" (the runs start
in the repository root). Module-level call counts make the failures land at a known step."""

import math

_calls = {"fails_on_third_call": 0, "flaky": 0}


def letters(prompts, completions, **columns):
  """Fraction of lowercase letters in the completion: a reward every model gets a signal from."""
  del prompts, columns
  return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


def fails_on_third_call(prompts, completions, **columns):
  """Fine twice, then NaN for the second completion: the run must stop at step 3."""
  _calls["fails_on_third_call"] += 1
  out = letters(prompts, completions, **columns)
  if _calls["fails_on_third_call"] >= 3:
    out[1] = math.nan
  return out


def flaky(prompts, completions, **columns):
  """Raises on every third call, else `letters`: with on_reward_error='skip' the run goes on."""
  _calls["flaky"] += 1
  if _calls["flaky"] % 3 == 0:
    raise RuntimeError("the grader timed out")
  return letters(prompts, completions, **columns)
