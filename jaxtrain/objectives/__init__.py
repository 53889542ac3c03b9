"""Training objectives as objects (see base.Objective): `get(config)` gives the run's."""

from __future__ import annotations

from jaxtrain.config import OBJECTIVES as NAMES
from jaxtrain.objectives.base import Objective
from jaxtrain.objectives.dpo import DPO
from jaxtrain.objectives.grpo import GRPO
from jaxtrain.objectives.lm import LanguageModel
from jaxtrain.objectives.reward import RewardModel

__all__ = ["DPO", "GRPO", "LanguageModel", "NAMES", "Objective", "RewardModel", "get"]


def get(config_or_name, *, dpo_beta: float | None = None) -> Objective:
  """The objective of a run config (train.objective and its settings group), or by name."""
  if isinstance(config_or_name, Objective):
    return config_or_name
  if isinstance(config_or_name, str):
    name, beta = config_or_name, 0.1 if dpo_beta is None else dpo_beta
    if name == "grpo":
      raise ValueError("the GRPO objective needs its settings: objectives.get(config)")
  else:
    name, beta = config_or_name.train.objective, config_or_name.dpo.beta
  if name == "lm":
    return LanguageModel()
  if name == "dpo":
    return DPO(beta)
  if name == "grpo":
    return GRPO(config_or_name.grpo)
  if name == "reward":
    return RewardModel(None if isinstance(config_or_name, str) else config_or_name.reward)
  raise ValueError(f"unknown objective {name!r}; the objectives are {NAMES}")
