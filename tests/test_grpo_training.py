"""GRPO inside the trainer, in-process: its rows, its train step (accumulation equals the full
batch, one update per rollout batch has ratio 1), the cached decode under LoRA, its config
checks and its FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import objectives
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.decoder import Decoder
from jaxtrain.models.sharding import create_model
from jaxtrain.objectives.grpo import loss as grpo, rewards
from jaxtrain.objectives.grpo.rollouts import completion_lengths, training_rows
from jaxtrain.train import setup as train_setup, loop as trainer
from tests.helpers import assert_one_line_config_error, mesh_of, small_config

G = 4


def grpo_config(**grpo_settings):
  c = small_config()
  c.train.objective = "grpo"
  c.data.source, c.data.format = "jsonl", "prompt"
  c.train.global_batch_size = 4  # prompts: x G = 16 rows
  c.grpo.num_generations = G
  c.grpo.max_new_tokens = 12
  c.grpo.reward_fns = "jaxtrain.objectives.grpo.rewards:similarity"
  for k, v in grpo_settings.items():
    setattr(c.grpo, k, v)
  return c


def test_training_rows_mark_exactly_the_completion_targets():
  prompt_BP = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], np.int32)
  lengths_B = np.array([3, 2], np.int32)
  tokens_BN = np.array([[11, 12, 2, 2], [13, 14, 15, 16]], np.int32)  # row 0 stops at EOS=2
  clen_B = completion_lengths(tokens_BN, eos_id=2)
  np.testing.assert_array_equal(clen_B, [3, 4])
  rows = training_rows(prompt_BP, lengths_B, tokens_BN, clen_B, seq_len=8)
  # Row 0: z = 5 6 7 11 12 2; position t predicts z[t+1]; completion targets are 11 12 2.
  np.testing.assert_array_equal(rows["inputs"][0], [5, 6, 7, 11, 12, 0, 0, 0])
  np.testing.assert_array_equal(rows["targets"][0], [6, 7, 11, 12, 2, 0, 0, 0])
  np.testing.assert_array_equal(rows["loss_mask"][0], [0, 0, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(rows["segment_ids"][0], [1, 1, 1, 1, 1, 0, 0, 0])
  # Row 1: z = 8 9 13 14 15 16 (no EOS within 4 tokens), all four completion tokens count.
  np.testing.assert_array_equal(rows["targets"][1], [9, 13, 14, 15, 16, 0, 0, 0])
  np.testing.assert_array_equal(rows["loss_mask"][1], [0, 1, 1, 1, 1, 0, 0, 0])
  assert completion_lengths(tokens_BN, None).tolist() == [4, 4]


def _rollout_batch(config, seed=0, old_logprobs=False):
  """A batch as the rollouts build it: prompts of different lengths, completions of different
  lengths, group-relative advantages of random rewards, made-up sampler log-probs."""
  rng = np.random.default_rng(seed)
  b, t, v = config.train.global_batch_size * G, config.train.seq_len, config.model.vocab_size
  n = config.grpo.max_new_tokens
  p = t - n
  prompt_BP = rng.integers(3, v, (b, p)).astype(np.int32)
  lengths_B = rng.integers(1, p + 1, b).astype(np.int32)
  tokens_BN = rng.integers(3, v, (b, n)).astype(np.int32)
  sampler_BN = (-rng.random((b, n)) * 8).astype(np.float32)
  rows = training_rows(prompt_BP, lengths_B, tokens_BN, rng.integers(1, n + 1, b), t, sampler_BN)
  rows["advantages"] = np.asarray(grpo.group_advantages(rng.random(b), G), np.float32)
  if old_logprobs:
    rows[grpo.OLD_LOGPROBS] = (-rng.random((b, t)) * 3).astype(np.float32)
  return rows


_SETUPS = {}


def _built(config, mesh_shape=(1, 1, 1)):
  """train_setup.build(config, mesh_of(mesh_shape)), once per config and mesh in this module:
  the tests of one config share its jitted init and train step (traced and compiled once)."""
  key = (str(config), tuple(mesh_shape))
  if key not in _SETUPS:
    _SETUPS[key] = train_setup.build(config, mesh_of(mesh_shape))
  return _SETUPS[key]


def _losses_and_grads(config, batch, mesh_shape=(1, 1, 1)):
  setup = _built(config, mesh_shape)
  state = train_setup.init_state(setup, seed=0)
  with jax.set_mesh(setup.mesh):
    after, metrics = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
  return metrics, jax.device_get(nnx.to_pure_dict(after.params))


@pytest.mark.slow
@pytest.mark.parametrize("iterations,mesh_shape", [(1, (2, 2, 1)), (2, (1, 1, 1))])
def test_accumulation_and_meshes_give_the_full_batch_step(iterations, mesh_shape):
  config = grpo_config(num_iterations=iterations)
  batch = _rollout_batch(config, old_logprobs=iterations > 1)
  want_metrics, want_params = _losses_and_grads(config, batch)
  # One update per batch of rollouts: the policy is the sampling policy, ratio 1, nothing clipped.
  if iterations == 1:
    assert float(want_metrics["clip_fraction"]) == 0.0
  else:
    assert float(want_metrics["clip_fraction"]) > 0.0  # made-up old log-probs: ratios far off 1
  config.train.grad_accum_steps = 2
  metrics, params = _losses_and_grads(config, batch, mesh_shape)
  # logprob_mismatch: a max over the microbatches and devices, not a mean.
  for k in ("loss", "kl", "clip_fraction", "grad_norm", "logprob_mismatch"):
    np.testing.assert_allclose(float(metrics[k]), float(want_metrics[k]), rtol=1e-5, atol=1e-7,
                               err_msg=f"{k} on {mesh_shape}")
  if iterations > 1:  # against the old log-probs, before any update
    mask = (batch["loss_mask"] > 0) & ~np.isnan(batch[grpo.SAMPLER_LOGPROBS])
    gap = np.abs(batch[grpo.OLD_LOGPROBS] - batch[grpo.SAMPLER_LOGPROBS])[mask].max()
    assert float(metrics["logprob_mismatch"]) == pytest.approx(float(gap), rel=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params,
               want_params)
  assert float(want_metrics["tokens"]) == config.train.global_batch_size * G  # sequences


@nnx.jit
def _full_logprobs(model, batch):
  """The targets' log-probs from the full logits, no chunking."""
  logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
  return jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                             batch["targets"][..., None], axis=-1)[..., 0]


@pytest.mark.slow
def test_loss_equals_grpo_loss_of_the_models_token_logprobs():
  """The objective's loss is jaxtrain.objectives.grpo.loss.grpo_loss of the policy's per-token
  log-probs, with the reference's (here: the same initial params; the default KL penalty,
  beta 0.04) and the batch's advantages."""
  config = grpo_config()
  assert config.grpo.beta > 0  # the reference takes part
  batch = _rollout_batch(config, seed=3)
  setup = _built(config)  # the accumulation test's one-device full-batch setup
  state = train_setup.init_state(setup, seed=0)
  model = nnx.merge(setup.graphdef, state.params)
  device_batch = {k: jnp.asarray(v) for k, v in batch.items()}
  logprobs = nnx.jit(grpo.token_logprobs, static_argnames="chunk_size")(
      model, device_batch, chunk_size=7)
  # Against the full logits, no chunking.
  full = _full_logprobs(model, device_batch)
  mask = batch["loss_mask"] > 0
  np.testing.assert_allclose(np.asarray(logprobs)[mask], np.asarray(full)[mask], rtol=1e-5,
                             atol=1e-5)
  want, want_metrics = grpo.grpo_loss(logprobs, logprobs, logprobs, batch["advantages"],
                                      batch["loss_mask"], beta=config.grpo.beta)
  with jax.set_mesh(setup.mesh):
    _, metrics = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
  np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5, atol=1e-7)
  assert float(metrics["kl"]) == pytest.approx(float(want_metrics["kl"]), abs=1e-7)
  # logprob_mismatch: the largest gap between the sampler's log-probs (made up here) and the
  # policy's, over the completion tokens, before the update.
  gap = np.abs(np.asarray(logprobs) - batch[grpo.SAMPLER_LOGPROBS])[mask].max()
  assert float(metrics["logprob_mismatch"]) == pytest.approx(float(gap), rel=1e-5)


@pytest.mark.slow
def test_cached_decode_equals_the_forward_under_lora_and_qlora():
  """The rollouts decode with adapters on (and a quantized base): the cached logits at every
  step equal the training forward's."""
  for quant in ("none", "nf4"):
    cfg = ModelConfig.of(vocab_size=64, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp_dim=128, max_position_embeddings=64,
                      remat_policy="none", init_std=0.3, lora_rank=4,
                      lora_targets=("q", "k", "v", "o", "gate", "up", "down"), base_quant=quant,
                      quant_group_size=16)
    model = create_model(cfg, mesh_of((1, 1, 1)), seed=0)
    # Non-zero adapters (they start at B = 0), so a decode that skipped them would differ.
    params = nnx.state(model, nnx.Param)
    noisy = jax.jit(lambda p: jax.tree.map(lambda x: x + 0.05 if x.ndim >= 2 else x, p))(params)
    nnx.update(model, noisy)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)
    want = nnx.jit(lambda m, t: m(t))(model, tokens)
    step = nnx.jit(Decoder.forward_with_cache)
    cache = model.empty_cache(2, 10)
    got, cache = step(model, tokens[:, :4], jnp.zeros(2, jnp.int32), cache)
    steps = [got]
    for i in range(4, 10):
      logits, cache = step(model, tokens[:, i:i + 1], jnp.full(2, i, jnp.int32), cache)
      steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(want), rtol=2e-4,
                               atol=2e-4, err_msg=quant)


@pytest.mark.parametrize("override,words", [
    ({"grpo.reward_fns": "jaxtrain.objectives.grpo.rewards:no_such_fn"},
     ["grpo.reward_fns", "no_such_fn"]),
    ({"grpo.reward_fns": "not_a_module_xyz:f"}, ["cannot import", "not_a_module_xyz"]),
    ({"grpo.num_generations": 1}, ["grpo.num_generations=1", "at least 2"]),
    ({"grpo.max_new_tokens": 300}, ["grpo.max_new_tokens=300", "256 positions"]),
    ({"grpo.max_new_tokens": 32}, ["train.seq_len=32"]),
    ({"grpo.on_reward_error": "ignore"}, ["grpo.on_reward_error"]),
    ({"grpo.num_iterations": 3}, ["grpo.num_iterations=3", "train.steps=10"]),
    ({"mesh.stage": 2}, ["mesh.stage=2", "grpo"]),
    ({"data.format": "chat"}, ["data.format='chat'", "data.format='prompt'"]),
])
def test_bad_grpo_settings_are_one_line_config_errors(override, words):
  config = grpo_config()
  for key, value in override.items():
    group, name = key.split(".")
    setattr(getattr(config, group), name, value)
  assert_one_line_config_error(config, 8, words)


def test_flops_add_reference_generation_and_old_logprobs():
  config = grpo_config()
  lm = objectives.get(small_config())
  g = objectives.get(config)
  assert g.tokens_per_step(config) == 4 * G * config.train.seq_len
  per_token = lm.flops_per_token(config)
  # Policy 6 + reference 2 + generation 2 (once per rollout batch) per weight and token.
  assert g.flops_per_token(config) == pytest.approx(per_token * (1 + 2 / 3))
  config.grpo.num_iterations, config.grpo.beta = 2, 0.0
  g = objectives.get(config)
  assert not g.uses_reference
  assert g.flops_per_token(config) == pytest.approx(per_token * (1 + (2 / 2) / 3))
  assert "reward_mean" in g.metric_names and "kl" in g.metric_names


def _rollouts(tmp_path, mesh_shape, **grpo_settings):
  from jaxtrain.data import prompts  # pylint: disable=import-outside-toplevel
  path = tmp_path / "prompts.jsonl"
  words = ["difo", "torefob", "bub", "jobuko", "zepu", "dubolu", "kaset", "ridomi"] * 4
  path.write_text("".join(f'{{"prompt": "reverse: {w}\\n", "answer": "{w[::-1]}", '
                          f'"n": {i}}}\n' for i, w in enumerate(words)))
  config = grpo_config(**grpo_settings)
  config.data.train_paths, config.data.eval_fraction = str(path), 0.2
  config.data.tokenizer = "byte"
  config.model.vocab_size = 384
  setup = train_setup.build(config, mesh_of(mesh_shape))
  state = train_setup.init_state(setup, seed=0)
  feeder = setup.objective.make_feeder(config, setup, str(tmp_path))
  return config, state, feeder, iter(prompts.make_train_iterator(config))


def test_warmup_rows_hold_the_reference_answer_with_advantage_one(tmp_path):
  config, _, feeder, it = _rollouts(tmp_path, (1, 1, 1), warmup_steps=1)
  local = next(it)
  rows = feeder._warmup_batch(local)  # pylint: disable=protected-access
  tok = feeder.tokenizer
  for b in range(0, len(rows["advantages"]), G):
    record = feeder.train_records[int(local["record_index"][b // G])]
    completion = rows["targets"][b][rows["loss_mask"][b] > 0]
    assert tok.decode(completion) == record["answer"] and completion[-1] == tok.eos_id
    for i in range(1, G):  # the whole group holds the same reference
      np.testing.assert_array_equal(rows["targets"][b + i], rows["targets"][b])
  np.testing.assert_array_equal(rows["advantages"], 1.0)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 1, 2)])
def test_sampled_rollouts_are_scored_grouped_and_seeded(tmp_path, mesh_shape):
  """On one device and sharded over data x tensor: G distinct samples per prompt, rewards from
  the function on the decoded text, zero-mean advantages per group, and the same completions
  again for the same step (the key is (seed, step)). Only ids of the tokenizer's vocabulary are
  drawn (the model's is padded past it), and the batch carries the sampler's log-probs of the
  completion tokens, which the train step finds equal to its own within float32 round-off."""
  config, state, feeder, it = _rollouts(tmp_path, mesh_shape)
  local = next(it)
  batch, metrics, _ = feeder._rollout(state, 5, local, 0)  # pylint: disable=protected-access
  # The rewards behind the advantages and the mean are the reward function's on the decoded
  # completions (the rows' completion targets), against each row's record.
  tok = feeder.tokenizer
  inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  mask = np.asarray(batch["loss_mask"]) > 0
  records = [feeder.train_records[int(i)] for i in np.repeat(local["record_index"], G)]
  prompts, completions = [], []
  for b, record in enumerate(records):
    prompts.append(tok.decode(inputs[b, :int(np.argmax(mask[b])) + 1]))
    completions.append(tok.decode(targets[b][mask[b]]))
    assert prompts[-1] == record["prompt"], (prompts[-1], record)
  want = np.asarray(rewards.similarity(prompts, completions,
                                       answer=[r["answer"] for r in records]))
  assert len(set(want.tolist())) > 1, want  # rewards that tell completions apart
  assert metrics["reward_mean"] == pytest.approx(float(want.mean()), rel=1e-6)
  np.testing.assert_allclose(np.asarray(batch["advantages"]),
                             np.asarray(grpo.group_advantages(want, G)), rtol=1e-6, atol=1e-6)
  again, _, _ = feeder._rollout(state, 5, local, 0)  # pylint: disable=protected-access
  other, _, _ = feeder._rollout(state, 6, local, 0)  # pylint: disable=protected-access
  targets = np.asarray(batch["targets"])
  np.testing.assert_array_equal(targets, np.asarray(again["targets"]))
  assert not np.array_equal(targets, np.asarray(other["targets"]))
  advantages = np.asarray(batch["advantages"]).reshape(-1, G)
  np.testing.assert_allclose(advantages.sum(axis=1), 0.0, atol=1e-4)
  assert len({tuple(r) for r in targets[:G]}) > 1  # a group's samples differ
  assert 0.0 <= metrics["reward_mean"] <= 1.0 and metrics["completion_len_mean"] >= 1
  assert np.asarray(batch["loss_mask"]).sum(axis=1).min() >= 1
  assert batch["targets"].shape == (config.train.global_batch_size * G, config.train.seq_len)
  # 384 model ids, 258 byte-tokenizer ids: a random model would draw a third of its tokens from
  # the padding.
  assert config.model.vocab_size == 384 and tok.vocab_size == 258
  assert targets[mask].max() < tok.vocab_size
  sampler = np.asarray(batch[grpo.SAMPLER_LOGPROBS])
  assert np.isfinite(sampler[mask]).all() and (sampler[mask] < 0).all()
  assert np.isnan(sampler[~mask]).all()
  with jax.set_mesh(feeder.setup.mesh):
    _, step_metrics = feeder.setup.train_step(state, batch)
  assert 0.0 <= float(step_metrics["logprob_mismatch"]) < 1e-4


def test_logprob_mismatch_with_warmup_and_reused_rollouts(tmp_path):
  """A warm-up batch samples nothing: logprob_mismatch is -inf there (the loop leaves it out of
  the log). With grpo.num_iterations=2 it compares the sampler with the old log-probs (the
  weights that sampled), so both steps of a batch of rollouts report the same small gap."""
  _, state, feeder, it = _rollouts(tmp_path, (1, 1, 1), warmup_steps=1, num_iterations=2)
  local = next(it)
  step = feeder.setup.train_step
  warmup, _, _ = feeder._rollout(state, 1, local, 0)  # pylint: disable=protected-access
  assert np.isnan(np.asarray(warmup[grpo.SAMPLER_LOGPROBS])).all()
  with jax.set_mesh(feeder.setup.mesh):
    state, metrics = step(state, warmup)
    assert float(metrics["logprob_mismatch"]) == -np.inf
    batch, _, _ = feeder._rollout(state, 3, local, 0)  # pylint: disable=protected-access
    assert grpo.OLD_LOGPROBS in batch
    state, first = step(state, batch)
    state, second = step(state, batch)
  assert float(first["loss"]) != float(second["loss"])  # the weights moved in between
  assert float(first["logprob_mismatch"]) == float(second["logprob_mismatch"])
  assert 0.0 <= float(first["logprob_mismatch"]) < 1e-4
