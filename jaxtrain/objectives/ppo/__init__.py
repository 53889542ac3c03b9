"""Proximal policy optimization: its loss and advantages (`loss.py`), its objective
(`objective.py`) and its rollouts (`rollouts.py`, GRPO's sampler with one completion per prompt
and a value head). Rewards come from GRPO's reward sources (`objectives/grpo/rewards.py`)."""
