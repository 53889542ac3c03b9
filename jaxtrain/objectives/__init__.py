"""Training objectives as objects (see base.Objective): `get(config)` gives the run's."""

from __future__ import annotations

from jaxtrain.config import OBJECTIVES as NAMES
from jaxtrain.data.documents import tokenizer_for
from jaxtrain.objectives.base import Objective
from jaxtrain.objectives.dpo.objective import DPO
from jaxtrain.objectives.grpo.objective import GRPO
from jaxtrain.objectives.lm import LanguageModel
from jaxtrain.objectives.ppo.objective import PPO
from jaxtrain.objectives.reward.objective import RewardModel

__all__ = ["DPO", "GRPO", "LanguageModel", "NAMES", "Objective", "PPO", "RewardModel", "get"]


def get(config_or_name, *, dpo_beta: float | None = None) -> Objective:
  """The objective of a run config (train.objective and its settings group), or by name."""
  if isinstance(config_or_name, Objective):
    return config_or_name
  if isinstance(config_or_name, str):
    name, beta = config_or_name, 0.1 if dpo_beta is None else dpo_beta
    if name in ("grpo", "ppo"):
      raise ValueError(f"the {name.upper()} objective needs its settings: objectives.get(config)")
  else:
    name, beta = config_or_name.train.objective, config_or_name.dpo.beta
  if name == "lm":
    return LanguageModel()
  if name == "dpo":
    return DPO(beta)
  if name == "grpo":
    return GRPO(config_or_name.grpo, vocab_limit=_tokenizer_vocab(config_or_name))
  if name == "ppo":
    return PPO(config_or_name.ppo, config_or_name.grpo,
               vocab_limit=_tokenizer_vocab(config_or_name))
  if name == "reward":
    return RewardModel(None if isinstance(config_or_name, str) else config_or_name.reward)
  raise ValueError(f"unknown objective {name!r}; the objectives are {NAMES}")


def _tokenizer_vocab(config) -> int | None:
  """The ids the RL rollouts draw from (the tokenizer's vocabulary, below the model's), the
  support of their policy. None where the tokenizer cannot be read here (e.g. a dry run away
  from its files: the compiled program is the same up to one elementwise mask; a real run then
  stops when its rollouts load the tokenizer)."""
  try:
    size = tokenizer_for(config.data.tokenizer).vocab_size
  except (ValueError, OSError):  # ConfigError included: a missing or unreadable tokenizer
    return None
  return size if size < config.model.vocab_size else None
