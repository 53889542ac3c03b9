"""Group relative policy optimization in one place.

  loss.py           group-relative advantages and the clipped policy loss (pure math)
  objective.py      the GRPO objective the trainer runs
  rollouts.py       its batches: completions sampled with the live weights, scored, turned into rows
  rewards.py        reward functions (`grpo.rewards`) and the checks around calling them
  reward_models.py  trained reward models as reward sources (`grpo.reward_models`)
"""
