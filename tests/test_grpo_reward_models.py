"""Reward models as GRPO reward sources (grpo.reward_models,
jaxtrain/objectives/grpo/reward_models.py): the entries and metric names, the rows a reward model
scores (its own training rows), scores over a mesh, the run's per-source metrics, the dry run's
memory, and the one-line refusals."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jaxtrain import objectives
from jaxtrain.checkpointing import weights as checkpoint_weights
from jaxtrain.config import ConfigError
from jaxtrain.data import formats
from jaxtrain.data.documents import tokenizer_for
from jaxtrain.data.preference import pair_rows
from jaxtrain.interop import run_weights
from jaxtrain.objectives.grpo import reward_models
from jaxtrain.objectives.reward import loss as reward
from tests.helpers import (REPO, assert_one_line_config_error, mesh_of, run_cli,
                           shipped_config)


def test_entries_and_the_metric_name_of_every_source():
  specs = reward_models.parse_specs("runs/rm, runs/b/checkpoints/300:0.5,gs://bucket/rm:-2")
  assert [(s.path, s.weight) for s in specs] == [
      ("runs/rm", 1.0), ("runs/b/checkpoints/300", 0.5), ("gs://bucket/rm", -2.0)]
  names = ["jaxtrain.objectives.grpo.rewards:similarity", "my.mod:similarity"]
  assert reward_models.source_names(names, specs) == ["similarity", "similarity_2", "rm", "b", "rm_2"]
  assert reward_models.parse_specs(" , ") == []
  with pytest.raises(ConfigError, match="not a number"):
    reward_models.parse_specs("runs/rm:half")


def test_reward_models_that_cannot_serve_are_one_line_errors(tmp_path):
  def refused(key, value, words):
    assert_one_line_config_error(shipped_config("grpo_tiny", **{key: value}), 1, words)
  refused("grpo.reward_models", str(tmp_path / "none"),
          ["grpo.reward_models", "none'", "no such directory"])
  lm = tmp_path / "lm_weights"  # a weights directory of a language model: its config.py
  lm.mkdir()
  shutil.copy(os.path.join(REPO, "configs", "tiny.py"), lm / "config.py")
  refused("grpo.reward_models", f"{lm}:0.5", ["grpo.reward_models", "lm_weights", "no score head"])
  refused("grpo.reward_models", str(tmp_path), ["grpo.reward_models", "no model config found"])
  refused("grpo.reward_fns", "", ["grpo.reward_fns=''", "grpo.reward_models=''"])


def _records(n=48):
  with open(os.path.join(REPO, "examples", "finetune", "preference.jsonl"),
            encoding="utf-8") as f:
    return [json.loads(line) for _, line in zip(range(n), f)]


def _scorer(workdir, mesh):
  spec = reward_models.RewardModelSpec(str(workdir), 1.0)
  return reward_models.RewardModelScorer(spec, mesh, row_length=32, hf_dtype="float32")


def test_a_completion_is_scored_on_the_reward_models_own_training_row(reward_tiny_workdir):
  scorer = _scorer(reward_tiny_workdir, mesh_of((1, 1, 1)))
  records = _records()
  chosen = [r["chosen"] for r in records]
  ids_BL, mask_BL = scorer.rows(records, chosen, np.ones(len(records), bool))
  config = ml_collections.ConfigDict(checkpoint_weights.saved_config(str(reward_tiny_workdir)))
  tokenizer = tokenizer_for(config.data.tokenizer)
  for i, record in enumerate(records):
    row = pair_rows(formats.record_features(tokenizer, record, "preference"), 33)
    n = int(row["chosen_attention_mask"].sum())
    np.testing.assert_array_equal(ids_BL[i, :n], row["chosen_input_ids"][:n])
    assert mask_BL[i].sum() == n
  # A completion cut off before EOS is scored without one.
  cut, _ = scorer.rows(records[:1], chosen[:1], np.zeros(1, bool))
  assert int((cut[0] != 0).sum()) == int((ids_BL[0] != 0).sum()) - 1

  # The scores are the reward model's sequence rewards; it ranks the shipped pairs as trained.
  got_chosen = scorer(records, chosen, np.ones(len(records), bool))
  got_rejected = scorer(records, [r["rejected"] for r in records], np.ones(len(records), bool))
  model, _ = run_weights.load_model(str(reward_tiny_workdir), mesh_of((1, 1, 1)))
  want = reward.sequence_rewards(model, jnp.asarray(ids_BL), jnp.asarray(mask_BL))
  np.testing.assert_allclose(got_chosen, np.asarray(want), rtol=1e-5, atol=1e-5)
  assert np.mean(got_chosen > got_rejected) >= 0.75


def test_reward_model_scores_on_a_sharded_mesh_match_one_device(reward_tiny_workdir):
  records = _records(16)
  chosen, ended = [r["chosen"] for r in records], np.ones(len(records), bool)
  one = _scorer(reward_tiny_workdir, mesh_of((1, 1, 1)))(records, chosen, ended)
  # Rows over data x fsdp, weights over fsdp and tensor.
  sharded = _scorer(reward_tiny_workdir, mesh_of((2, 2, 2)))(records, chosen, ended)
  np.testing.assert_allclose(sharded, one, rtol=1e-5, atol=1e-5)


SMALL = ["--config=configs/grpo_tiny.py", "--config.train.global_batch_size=4",
         "--config.grpo.num_generations=4", "--config.grpo.max_new_tokens=8",
         "--config.train.seq_len=28", "--config.train.steps=4", "--config.train.log_every=1",
         "--config.train.eval_every=4", "--config.train.eval_batches=1"]


@pytest.mark.slow(seconds=20)
def test_grpo_with_a_reward_model_and_a_function_logs_both_sources(reward_tiny_workdir,
                                                                   tmp_path):
  workdir = tmp_path / "grpo_rm"
  proc = run_cli(*SMALL, f"--workdir={workdir}",
                 f"--config.grpo.reward_models={reward_tiny_workdir}:0.5")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert f"reward model {reward_tiny_workdir} x 0.5" in proc.stdout
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  train = [r for r in rows if "loss" in r]
  assert len(train) == 4
  for r in train:  # the total is the function's reward plus the model's, weighted
    assert r["reward_mean"] == pytest.approx(
        r["reward_similarity_mean"] + 0.5 * r["reward_reward_tiny_mean"], abs=1e-9)
  evals = [r for r in rows if "eval_reward_mean" in r]
  assert {"eval_reward_similarity_mean", "eval_reward_reward_tiny_mean"} <= set(evals[-1])

  # The dry run counts the reward model's weights: exact bytes, in the total.
  config = shipped_config("grpo_tiny", **{"grpo.reward_models": str(reward_tiny_workdir)})
  resident = objectives.get(config).resident_bytes(config, mesh_of((1, 1, 1)))
  rm_config = ml_collections.ConfigDict(checkpoint_weights.saved_config(str(reward_tiny_workdir)))
  from jaxtrain.models import cost  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.config import ModelConfig  # pylint: disable=import-outside-toplevel
  assert resident == 4 * cost.param_count(ModelConfig.from_config(rm_config).arch)
  proc = run_cli(*SMALL, "--dry_run", f"--config.grpo.reward_models={reward_tiny_workdir}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "reward models" in proc.stdout and "grpo.reward_models" in proc.stdout


def test_a_hugging_face_reward_model_serves_as_a_source():
  """A *ForSequenceClassification directory (the transformers fixture) scores with its own
  tokenizer (its tokenizer.json), as `interop.hf.load_model` and `sequence_rewards` do."""
  from jaxtrain.interop import hf  # pylint: disable=import-outside-toplevel
  path = os.path.join(REPO, "tests", "fixtures", "hf_llama_reward")
  spec = reward_models.RewardModelSpec(path, 2.0)
  assert reward_models.source_names([], [spec]) == ["hf_llama_reward"]
  scorer = reward_models.RewardModelScorer(spec, mesh_of((1, 1, 1)), row_length=16,
                                           hf_dtype="float32")
  records = [{"prompt": "reverse: abc\n"}, {"prompt": "reverse: xy\n"}]
  completions, ended = ["cba", "yx!"], np.array([True, False])
  got = scorer(records, completions, ended)
  ids_BL, mask_BL = scorer.rows(records, completions, ended)
  model, _ = hf.load_model(path)
  want = reward.sequence_rewards(model, jnp.asarray(ids_BL), jnp.asarray(mask_BL))
  np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
  assert reward_models.weight_bytes(spec, mesh_of((1, 1, 1)), "float32") == 4 * sum(
      int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
