"""Reward functions: resolving "module:function", the shipped rewards, and a failing or
malformed reward stopping with one line that names it."""

import math

import numpy as np
import pytest

from jaxtrain.objectives.grpo import rewards


def test_resolve_names_what_is_missing():
  assert rewards.resolve("jaxtrain.objectives.grpo.rewards:exact_match") is rewards.exact_match
  for name, words in [("exact_match", "module:function"),
                      ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
                      ("jaxtrain.objectives.grpo.rewards:nope", "has no function 'nope'"),
                      ("jaxtrain.rewards:exact_match",  # an older spelling of the built-ins
                       "reward functions are in jaxtrain.objectives.grpo.rewards")]:
    with pytest.raises(ValueError, match=words):
      rewards.resolve(name)


def test_shipped_rewards():
  completions = ["<answer> 42 </answer>", "41", "I think <answer>4</answer> <answer>42</answer>",
                 "no tags 42"]
  answers = ["42", "41", "42", 42]
  assert rewards.exact_match([""] * 4, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0]
  assert rewards.answer_format([""] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
  # Partial credit: 2 * matched / (len(answer) + len(reference)).
  got = rewards.similarity([""] * 4, ["ofid", "ofix", "<answer>of</answer>", ""],
                           answer=["ofid"] * 4)
  assert got == [1.0, 2 * 3 / 8, 2 * 2 / 6, 0.0]


def test_score_sums_the_functions_with_columns():
  fns = [("exact", rewards.exact_match), ("format", rewards.answer_format)]
  got = rewards.score(fns, ["p", "p"], ["<answer>7</answer>", "7"], {"answer": ["7", "8"]})
  np.testing.assert_array_equal(got, [2.0, 0.0])


@pytest.mark.parametrize("fn,words", [
    (lambda p, c, **k: 1 / 0, "reward function bad raised ZeroDivisionError: division by zero"),
    (lambda p, c, **k: [1.0], "reward function bad returned 1 rewards for 2 completions"),
    (lambda p, c, **k: [1.0, math.nan], "reward function bad returned nan for completion 1"),
    (lambda p, c, **k: None, "reward function bad returned NoneType None"),
])
def test_a_bad_reward_is_one_line_naming_the_function(fn, words):
  with pytest.raises(rewards.RewardError) as e:
    rewards.score([("bad", fn)], ["a", "b"], ["x", "y"], {})
  assert words in str(e.value) and "\n" not in str(e.value)
