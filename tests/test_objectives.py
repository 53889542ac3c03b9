"""Objectives as objects: one definition of each objective's batch, rows and FLOPs, which the
meter, the run table and the dry run all read."""

import jax.numpy as jnp
import pytest

from jaxtrain import objectives
from jaxtrain.models.config import architecture_of
from jaxtrain.train import measure
from jaxtrain.train import metrics
from tests.helpers import small_config


def _config(objective):
  c = small_config()
  c.train.objective = objective
  if objective == "dpo":
    c.data.format, c.dpo.beta = "preference", 0.25
  return c


def test_get_reads_the_objective_and_its_settings_from_the_config():
  assert isinstance(objectives.get(_config("lm")), objectives.LanguageModel)
  dpo = objectives.get(_config("dpo"))
  assert isinstance(dpo, objectives.DPO) and dpo.beta == 0.25 and dpo.uses_reference
  assert objectives.get("dpo", dpo_beta=0.5).beta == 0.5
  assert objectives.get(dpo) is dpo
  with pytest.raises(ValueError, match="unknown objective 'kto'"):
    objectives.get("kto")
  with pytest.raises(ValueError, match="the PPO objective needs its settings"):
    objectives.get("ppo")
  assert isinstance(objectives.get("reward"), objectives.RewardModel)
  assert set(objectives.NAMES) == {"lm", "dpo", "grpo", "reward", "ppo"}


def test_language_model_batches_and_flops():
  config = _config("lm")
  b, t = config.train.global_batch_size, config.train.seq_len
  lm = objectives.get(config)
  shapes = lm.batch_shapes(config)
  assert set(shapes) == {"inputs", "targets", "loss_mask", "segment_ids", "positions"}
  assert shapes["inputs"] == ((b, t), jnp.int32) and shapes["loss_mask"] == ((b, t), jnp.float32)
  assert lm.tokens_per_step(config) == b * t
  assert lm.flops_per_step(config) == metrics.flops_per_step(architecture_of(config), t, b)
  assert measure.analytic_flops_per_step(config) == lm.flops_per_step(config)
  assert lm.metric_names == () and not lm.uses_reference


def test_dpo_batches_are_pairs_of_longer_rows_and_flops_add_the_reference_forward():
  config = _config("dpo")
  b, t = config.train.global_batch_size, config.train.seq_len
  dpo = objectives.get(config)
  shapes = dpo.batch_shapes(config)
  assert len(shapes) == 6 and all(shape == (b, t + 1) for shape, _ in shapes.values())
  assert shapes["chosen_loss_mask"][1] == jnp.float32
  assert shapes["rejected_input_ids"][1] == jnp.int32
  assert dpo.tokens_per_step(config) == 2 * b * (t + 1)
  per_token = metrics.flops_per_token(architecture_of(config), t + 1)
  assert dpo.flops_per_step(config) == pytest.approx(per_token * 4 / 3 * 2 * b * (t + 1))
  assert measure.analytic_tokens_per_step(config) == dpo.tokens_per_step(config)
  assert "reward_accuracy" in dpo.metric_names and dpo.unit == "pairs"
  assert dpo.describe_row(t) == f"a DPO row (train.seq_len + 1 = {t + 1} tokens)"


def test_each_objective_checks_its_own_settings():
  from jaxtrain.config import ConfigError  # pylint: disable=import-outside-toplevel
  lm = _config("lm")
  lm.data.format = "preference"
  with pytest.raises(ConfigError, match="preference pairs train only with train.objective='dpo'"):
    objectives.get(lm).check(lm)
  dpo = _config("dpo")
  dpo.dpo.beta = 0.0
  with pytest.raises(ConfigError, match="dpo.beta=0.0: must be positive"):
    objectives.get(dpo).check(dpo)
  dpo.dpo.beta, dpo.data.format = 0.1, "text"
  with pytest.raises(ConfigError, match="data.format='text'"):
    objectives.get(dpo).check(dpo)
