"""Reward models (jaxtrain/objectives/reward/loss.py): the score head, the reward at a sequence's
last real token, the Bradley-Terry loss and its metrics against numpy, and reward_tiny's
training."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import cost
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import create_model
from jaxtrain.objectives.reward import loss as reward
from tests.helpers import assert_one_line_config_error, mesh_of, run_cli, shipped_config

CFG = ModelConfig.of(vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_dim=64, max_position_embeddings=64, remat_policy="none",
                     score_head=True)


@functools.lru_cache(maxsize=None)
def _model(seed=0):
  return create_model(CFG, mesh_of((1, 1, 1)), seed=seed)


# Jitted rather than op by op: each primitive run outside jit compiles on its own.
_forward = nnx.jit(lambda model, ids: model(ids))
_sequence_rewards = nnx.jit(reward.sequence_rewards)


def _rows(rng, b, t):
  """Right-padded rows of random lengths (at least 2 tokens), zeros after the end."""
  ids = rng.integers(1, CFG.arch.vocab_size, (b, t)).astype(np.int32)
  mask = np.zeros((b, t), np.int32)
  for i in range(b):
    n = int(rng.integers(2, t + 1))
    mask[i, :n] = 1
    ids[i, n:] = 0
  return jnp.asarray(ids), jnp.asarray(mask)


def test_the_score_head_replaces_the_vocabulary_head():
  model = _model()
  params = nnx.state(model, nnx.Param)
  names = set(nnx.to_pure_dict(params))
  assert "score_D1" in names and "head_DV" not in names
  assert sum(x.size for x in jax.tree.leaves(params)) == cost.param_count(CFG.arch)
  ids, _ = _rows(np.random.default_rng(0), 2, 8)
  assert _forward(model, ids).shape == (2, 8)
  with pytest.raises(ValueError, match="score head"):
    model.head_weights()


def test_a_sequence_reward_is_its_last_real_token_score_and_padding_does_not_change_it():
  model = _model()
  ids, mask = _rows(np.random.default_rng(1), 4, 12)
  got = _sequence_rewards(model, ids, mask)
  for b in range(4):
    n = int(mask[b].sum())
    alone = _forward(model, ids[b:b + 1, :n])  # the unpadded sequence on its own
    np.testing.assert_allclose(got[b], alone[0, n - 1], rtol=1e-5, atol=1e-6)


def test_loss_and_metrics_match_the_formula():
  rng = np.random.default_rng(2)
  chosen, rejected = rng.normal(size=5) * 3, rng.normal(size=5) * 3
  for margin, center in [(0.0, 0.0), (0.5, 0.01)]:
    loss, metrics = reward.pair_terms(jnp.asarray(chosen), jnp.asarray(rejected), margin=margin,
                                      center_coef=center)
    diff = chosen - rejected
    want = np.log1p(np.exp(-(diff - margin))) + center * (chosen + rejected) ** 2
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_array_equal(metrics["accuracy"], (diff > 0).astype(np.float32))
    np.testing.assert_allclose(metrics["margin_mean"], diff, rtol=1e-6)
    np.testing.assert_allclose(metrics["reward_chosen_mean"], chosen, rtol=1e-6)
    np.testing.assert_allclose(metrics["reward_rejected_mean"], rejected, rtol=1e-6)


def test_reward_sums_score_both_sides_in_one_pass():
  model = _model()
  rng = np.random.default_rng(3)
  (ci, cm), (ri, rm) = _rows(rng, 3, 10), _rows(rng, 3, 10)
  batch = {"chosen_input_ids": ci, "chosen_attention_mask": cm,
           "rejected_input_ids": ri, "rejected_attention_mask": rm}
  loss_sum, count, sums = nnx.jit(reward.reward_sums)(model, batch)
  r_c, r_r = _sequence_rewards(model, ci, cm), _sequence_rewards(model, ri, rm)
  assert float(count) == 3
  np.testing.assert_allclose(loss_sum, np.sum(np.log1p(np.exp(-(r_c - r_r)))), rtol=1e-5)
  np.testing.assert_allclose(sums["accuracy"], np.sum(r_c > r_r))
  del batch["rejected_attention_mask"]
  with pytest.raises(KeyError, match="rejected_attention_mask"):
    reward.reward_sums(model, batch)


@pytest.mark.parametrize("changes,words", [
    ({"data.format": "lm"}, ["train.objective='reward'", "data.format='lm'", "preference"]),
    ({"reward.margin": -1.0}, ["reward.margin=-1.0", ">= 0"]),
])
def test_settings_a_reward_model_cannot_train_with_are_one_line_errors(changes, words):
  assert_one_line_config_error(shipped_config("reward_tiny", **changes), 1, words)


@pytest.mark.slow(seconds=40)
def test_reward_tiny_scores_held_out_pairs_well_above_chance(reward_tiny_workdir):
  """configs/reward_tiny.py as shipped: the held-out accuracy its docstring states (0.75 or more
  at step 300), every reward metric in metrics.jsonl."""
  workdir = reward_tiny_workdir
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")]
  last_eval = [r for r in rows if "eval_accuracy" in r][-1]
  assert last_eval["step"] == 300 and last_eval["eval_accuracy"] >= 0.75, last_eval
  train_rows = [r for r in rows if "loss" in r]
  assert {"accuracy", "margin_mean", "reward_chosen_mean", "reward_rejected_mean"} <= set(
      train_rows[-1])


def test_a_language_model_checkpoint_starts_a_reward_model(tmp_path):
  lm = tmp_path / "lm"
  # tiny.py's model on short rows and one eval batch (the checkpoint holds the same weights'
  # shapes; executing 16x256-token steps and eight eval batches took most of the test's time).
  proc = run_cli("--config=configs/tiny.py", "--config.train.steps=2",
                 "--config.train.eval_every=100", "--config.train.log_every=1",
                 "--config.train.global_batch_size=8", "--config.train.seq_len=64",
                 "--config.train.eval_batches=1",
                 "--config.checkpoint.every_steps=2", f"--workdir={lm}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  workdir = tmp_path / "reward"
  proc = run_cli("--config=configs/reward_tiny.py", "--config.train.steps=1",
                 "--config.train.log_every=1", "--config.train.eval_batches=1",
                 f"--config.checkpoint.init_from={lm}", f"--workdir={workdir}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  first = [r for r in map(json.loads, open(workdir / "metrics.jsonl", encoding="utf-8"))
           if "loss" in r][0]
  # The zero score head: both rewards 0, the loss log 2, no pair counted as won.
  assert first["reward_chosen_mean"] == first["reward_rejected_mean"] == 0.0
  assert first["loss"] == pytest.approx(math.log(2), rel=1e-6) and first["accuracy"] == 0.0
