"""LoRA and QLoRA for the objectives that add a head: the reward model's score head and PPO's
value head train beside the adapters, start from the base's head (zero for a head new to it),
are saved in the run's checkpoint and merged into the plain model on export."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jaxtrain.checkpointing import weights as checkpoint_weights
from jaxtrain.data import formats
from jaxtrain.data.documents import tokenizer_for
from jaxtrain.data.preference import pair_rows
from jaxtrain.interop import run_weights
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model, init_params_fn
from jaxtrain.models.variables import Head
from jaxtrain.objectives.reward import loss as reward
from jaxtrain.peft import state as peft_state
from tests.helpers import REPO, mesh_of, run_cli

CFG = ModelConfig.of(vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_dim=64, max_position_embeddings=64, remat_policy="none",
                     score_head=True, value_head=False)


def _records(workdir, key):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if key in r]


def test_under_lora_the_heads_train_and_start_from_the_base():
  lora = CFG.replace(lora_rank=4, lora_targets=("q", "v"))
  mesh = mesh_of((1, 1, 1))
  _, (abstract_trainable, abstract_frozen), _ = abstract_model(
      lora, mesh, filters=(peft_state.trainable_filter(lora), ...))
  trainable = set(nnx.to_pure_dict(abstract_trainable))
  assert "score_D1" in trainable and "score_D1" not in nnx.to_pure_dict(abstract_frozen)
  # Master weights in float32 whatever the base's storage dtype.
  bf16_head = abstract_model(lora.replace(param_dtype="bfloat16"), mesh)[1]["score_D1"]
  assert isinstance(bf16_head, Head) and bf16_head.dtype == jnp.float32
  with jax.set_mesh(mesh):
    fresh = jax.jit(init_params_fn(lora, trainable_only=True))(jax.random.key(0))
    base = jax.jit(init_params_fn(peft_state.plain_config(lora)))(jax.random.key(1))
    started = jax.jit(peft_state.heads_from_base)(fresh, base)
  np.testing.assert_array_equal(started["score_D1"][...], base["score_D1"][...])
  assert not np.array_equal(fresh["score_D1"][...], base["score_D1"][...])
  # The adapters are left as they were.
  started_flat = dict(nnx.to_flat_state(started))
  for path, leaf in nnx.to_flat_state(fresh):
    if path[0] != "score_D1":
      np.testing.assert_array_equal(leaf[...], started_flat[path][...])


def _pair_accuracy(model, config, n=64):
  """The share of the first n pairs of the shipped preference data whose chosen answer the model
  scores above the rejected one."""
  tokenizer = tokenizer_for(config.data.tokenizer)
  with open(os.path.join(REPO, "examples", "finetune", "preference.jsonl"),
            encoding="utf-8") as f:
    records = [json.loads(line) for _, line in zip(range(n), f)]
  rows = [pair_rows(formats.record_features(tokenizer, r, "preference"),
                    config.train.seq_len + 1) for r in records]
  rows = [r for r in rows if r is not None]
  stack = lambda k: jnp.asarray(np.stack([r[k] for r in rows]))
  sequence_rewards = nnx.jit(reward.sequence_rewards)  # not op by op
  chosen = sequence_rewards(model, stack("chosen_input_ids"), stack("chosen_attention_mask"))
  rejected = sequence_rewards(model, stack("rejected_input_ids"),
                              stack("rejected_attention_mask"))
  return float(np.mean(np.asarray(chosen) > np.asarray(rejected)))


@pytest.mark.slow(seconds=25)
def test_a_lora_reward_model_learns_and_its_checkpoint_merges_into_a_plain_reward_model(
    tmp_path):
  workdir = tmp_path / "lora_reward"
  proc = run_cli("--config=configs/reward_tiny.py", f"--workdir={workdir}",
                 "--config.lora.rank=8", "--config.optim.learning_rate=2e-3",
                 "--config.train.steps=50", "--config.train.eval_every=50",
                 "--config.train.log_every=10", "--config.checkpoint.every_steps=50")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  evals = _records(workdir, "eval_accuracy")
  assert evals[-1]["step"] == 50 and evals[-1]["eval_accuracy"] >= 0.7, evals
  config = ml_collections.ConfigDict(checkpoint_weights.saved_config(str(workdir)))
  model, _ = run_weights.load_plain_model(str(workdir), config, mesh_of((1, 1, 1)))
  assert model.cfg.peft.lora_rank == 0 and model.cfg.arch.score_head
  # The trained head and adapters both made it into the plain model: it ranks the pairs as the
  # run's eval did, far from the zero head's 0.
  assert _pair_accuracy(model, config) >= 0.7


@pytest.mark.slow(seconds=25)
def test_qlora_reward_and_lora_ppo_train_their_heads(tmp_path):
  proc = run_cli("--config=configs/reward_tiny.py", f"--workdir={tmp_path / 'qlora'}",
                 "--config.lora.rank=8", "--config.lora.quantize_base=int8",
                 "--config.optim.learning_rate=2e-3", "--config.train.steps=20",
                 "--config.train.eval_every=20", "--config.train.eval_batches=1",
                 "--config.train.log_every=10")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  first, last = _records(tmp_path / "qlora", "loss")[0], _records(tmp_path / "qlora", "loss")[-1]
  assert last["loss"] < first["loss"] and last["accuracy"] > 0.5

  workdir = tmp_path / "ppo"
  proc = run_cli("--config=configs/ppo_tiny.py", f"--workdir={workdir}", "--config.lora.rank=4",
                 "--config.train.global_batch_size=8", "--config.grpo.max_new_tokens=8",
                 "--config.train.seq_len=28", "--config.train.log_every=1",
                 "--config.train.steps=8", "--config.train.eval_every=100",
                 "--config.train.eval_batches=1", "--config.checkpoint.every_steps=8",
                 "--config.ppo.epochs=2")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = _records(workdir, "value_loss")
  assert len(rows) == 8 and all(np.isfinite(r["value_loss"]) for r in rows)
  # The value head starts at zero (new to the base) and learns: the value loss falls.
  assert rows[-1]["value_loss"] < rows[0]["value_loss"]
  saved = ml_collections.ConfigDict(checkpoint_weights.saved_config(str(workdir)))
  model, _ = run_weights.load_plain_model(str(workdir), saved, mesh_of((1, 1, 1)))
  assert float(jnp.abs(model.value_D1[...]).max()) > 0
