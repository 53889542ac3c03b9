"""The RL log-probs are of the distribution the rollouts are drawn from (issue 54): at
grpo.temperature over the tokenizer's ids, before top-p's cut, in the sampler's record and in
every log-prob the trainer takes (GRPO's loss and reference, PPO's policy), so the importance
ratio starts at 1 on the sampled tokens and the policy gradient is of the sampling policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import objectives
from jaxtrain.generate import sampler as generate
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import create_model
from jaxtrain.objectives.forward import Frozen
from jaxtrain.objectives.grpo import loss as grpo
from jaxtrain.objectives.grpo.rollouts import completion_lengths, training_rows
from tests.helpers import mesh_of, small_config

TEMPERATURE, TOP_P = 0.7, 0.9
VOCAB, TOKENIZER_VOCAB = 64, 50  # the model's vocabulary is padded past the tokenizer's
NEW, SEQ_LEN, CHUNK = 8, 16, 8
TOLERANCE = 1e-5  # float32 on CPU: the cached decode and the chunked head agree to round-off


def _model(seed=0, value_head=False):
  # Large weights: peaked softmaxes, so the temperature and the top-p cut both change things.
  cfg = ModelConfig.of(vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_position_embeddings=64, remat_policy="none",
                       init_std=0.3, value_head=value_head)
  return create_model(cfg, mesh_of((1, 1, 1)), seed=seed)


def _settings():
  c = small_config()
  c.grpo.temperature, c.grpo.top_p = TEMPERATURE, TOP_P
  c.grpo.max_new_tokens = NEW
  c.ppo.epsilon = 1e-4  # PPO's clip range: any ratio off 1 by more is counted as clipped
  return c


def _rollout_rows(model, top_p=TOP_P):
  """Rows of completions drawn by the real sampler at grpo.temperature and grpo.top_p (as
  rollouts.Rollouts builds its SamplingConfig), with the sampler's recorded log-probs."""
  sampling = generate.SamplingConfig(max_new_tokens=NEW, temperature=TEMPERATURE, top_p=top_p,
                                     vocab_size=TOKENIZER_VOCAB)
  prompt_BP = np.array([[1, 5, 9, 2, 7], [3, 0, 0, 0, 0], [4, 4, 8, 0, 0], [2, 6, 0, 0, 0]],
                       np.int32)
  lengths_B = np.array([5, 1, 3, 2], np.int32)
  tokens_BN, sampler_BN = (np.asarray(x) for x in nnx.jit(
      lambda m, p, n, k: generate.sample_continuations(m, p, n, k, sampling,
                                                       with_logprobs=True))(
      model, jnp.asarray(prompt_BP), jnp.asarray(lengths_B), jax.random.key(0)))
  assert tokens_BN.max() < TOKENIZER_VOCAB
  rows = training_rows(prompt_BP, lengths_B, tokens_BN, completion_lengths(tokens_BN, None),
                       SEQ_LEN, sampler_BN)
  rows["advantages"] = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
  return {k: jnp.asarray(v) for k, v in rows.items()}


def _full_logprobs(model, rows, temperature):
  """[B, T] log-probs of the targets from the whole-sequence logits: softmax(logits / T) over
  the tokenizer's ids (a reference written without the chunked head)."""
  logits_BTV = model(rows["inputs"], rows["positions"], rows["segment_ids"])
  all_BTV = jax.nn.log_softmax(logits_BTV[..., :TOKENIZER_VOCAB] / temperature, axis=-1)
  return np.asarray(jnp.take_along_axis(all_BTV, rows["targets"][..., None], axis=-1)[..., 0])


def _gap(a_BT, b_BT, rows):
  mask_BT = np.asarray(rows["loss_mask"]) > 0
  return float(np.abs(np.asarray(a_BT) - np.asarray(b_BT))[mask_BT].max())


def test_grpo_loss_and_reference_use_the_tempered_distribution_the_sampler_recorded():
  objective = objectives.GRPO(_settings().grpo, vocab_limit=TOKENIZER_VOCAB)
  policy, reference = _model(seed=0), _model(seed=1)
  rows = _rollout_rows(policy)
  sampler_BT = rows[grpo.SAMPLER_LOGPROBS]
  graphdef, state = nnx.split(policy)
  frozen = Frozen(reference=nnx.split(reference)[1])
  reference_logprobs, sums = objective.loss_sums(graphdef, CHUNK)
  ref_BT = jax.jit(reference_logprobs)(state, frozen, rows)
  # The loss's own log-probs of the sampled tokens: logprob_mismatch is their largest gap to the
  # sampler's (one iteration: they are also the ratio's old log-probs).
  _, _, metrics = jax.jit(sums)(state, frozen, rows, ref_BT, None)
  mismatch = float(metrics[grpo.LOGPROB_MISMATCH])
  assert 0.0 <= mismatch < TOLERANCE, (
      f"the GRPO loss's log-probs differ from the sampler's by {mismatch:.3g} (temperature "
      f"{TEMPERATURE}, top-p {TOP_P})")
  # Both are of the distribution the tokens were drawn from: the tempered full softmax (before
  # the top-p cut), which here differs from temperature 1's by far more than round-off.
  drawn_from = _gap(sampler_BT, _full_logprobs(policy, rows, TEMPERATURE), rows)
  assert drawn_from < TOLERANCE, (
      f"the sampler's (and so the loss's) log-probs are off the tempered softmax the tokens "
      f"were drawn from by {drawn_from:.3g} (temperature {TEMPERATURE}, top-p {TOP_P})")
  assert _gap(sampler_BT, _full_logprobs(policy, rows, 1.0), rows) > 0.05
  # The reference's log-probs (the KL term) are at the same temperature.
  assert _gap(ref_BT, _full_logprobs(reference, rows, TEMPERATURE), rows) < TOLERANCE
  # The function the loss uses, called directly (the old log-probs of several iterations).
  direct_BT = objective.policy_logprobs(policy, rows, chunk_size=CHUNK)
  assert _gap(direct_BT, sampler_BT, rows) < TOLERANCE


def test_ppo_policy_logprobs_and_ratio_match_the_sampler():
  c = _settings()
  objective = objectives.PPO(c.ppo, c.grpo, vocab_limit=TOKENIZER_VOCAB)
  policy = _model(seed=0, value_head=True)
  rows = _rollout_rows(policy)
  sampler_BT = rows[grpo.SAMPLER_LOGPROBS]
  # The loss's ratio at the sampling weights, against the log-probs of the distribution the
  # tokens were drawn from (softmax(logits / temperature), written out): 1 on every token, so
  # nothing leaves even a 1e-4 clip range ...
  mask_BT = rows["loss_mask"]
  drawn_BT = _full_logprobs(policy, rows, TEMPERATURE)
  batch = {**rows, "old_logprobs": jnp.where(mask_BT > 0, drawn_BT, 0.0),
           "old_values": jnp.zeros_like(mask_BT), "returns": jnp.zeros_like(mask_BT),
           "advantages": jnp.where(mask_BT > 0, 1.0, 0.0) * rows["advantages"][:, None]}
  graphdef, state = nnx.split(policy)
  _, sums = objective.loss_sums(graphdef, CHUNK)
  _, _, metrics = jax.jit(sums)(state, None, batch, None, None)
  assert float(metrics["clip_fraction"]) == 0.0, (
      f"PPO's ratio against the sampling distribution's log-probs leaves 1 ± 1e-4 on a share "
      f"{float(metrics['clip_fraction']) / 4:.3g} of the tokens (temperature {TEMPERATURE}, "
      f"top-p {TOP_P})")
  # ... and what the rollouts' prepare pass takes as the old log-probs (beside the values) is
  # what the sampler recorded.
  old_BT, _ = objective.policy_logprobs(policy, rows, chunk_size=CHUNK, with_values=True)
  assert _gap(old_BT, sampler_BT, rows) < TOLERANCE


def test_top_p_cuts_the_draws_but_not_the_recorded_distribution():
  """Top-p changes which tokens can be drawn, not the log-probs: those of the same tokens are
  the tempered full softmax's whether or not a cut was applied (the documented choice)."""
  policy = _model()
  cut, uncut = _rollout_rows(policy), _rollout_rows(policy, top_p=1.0)
  for rows in (cut, uncut):
    assert _gap(rows[grpo.SAMPLER_LOGPROBS], _full_logprobs(policy, rows, TEMPERATURE),
                rows) < TOLERANCE
  # The cut was in force: some drawn token's nucleus left out a share of the tempered mass.
  logits_BTV = policy(cut["inputs"], cut["positions"], cut["segment_ids"])
  probs_BTV = jax.nn.softmax(logits_BTV[..., :TOKENIZER_VOCAB] / TEMPERATURE, axis=-1)
  probs_NV = np.asarray(probs_BTV)[np.asarray(cut["loss_mask"]) > 0]
  sorted_NV = -np.sort(-probs_NV, axis=-1)
  kept_N = ((np.cumsum(sorted_NV, axis=-1) - sorted_NV) < TOP_P).sum(axis=-1)
  assert (kept_N < TOKENIZER_VOCAB // 2).any()


def test_greedy_and_zero_temperature_stay_finite():
  """Greedy decoding records temperature 1's log-probs (no division by 0); the trainer refuses a
  temperature that is not positive rather than dividing by it."""
  logits_BV = jnp.asarray([[0.0, 2.0, 1.0], [3.0, 0.0, -1.0]], jnp.float32)
  tokens_B = jnp.asarray([1, 0], jnp.int32)
  got = generate.sampled_logprobs(logits_BV, tokens_B, 0.0)
  want = jax.nn.log_softmax(logits_BV, axis=-1)[jnp.arange(2), tokens_B]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(generate.sampled_logprobs(logits_BV, tokens_B, 0.5)),
                             np.asarray(jax.nn.log_softmax(logits_BV / 0.5)[jnp.arange(2),
                                                                            tokens_B]),
                             rtol=1e-6)
  policy = _model()
  greedy = generate.SamplingConfig(max_new_tokens=4)
  _, logprobs_BN = nnx.jit(lambda m, p, n, k: generate.sample_continuations(
      m, p, n, k, greedy, with_logprobs=True))(
      policy, jnp.asarray([[1, 2, 3]], jnp.int32), jnp.asarray([3], jnp.int32),
      jax.random.key(0))
  assert np.isfinite(np.asarray(logprobs_BN)).all() and (np.asarray(logprobs_BN) < 0).all()
  rows = {k: jnp.zeros((1, 4), jnp.int32) for k in grpo.TOKEN_KEYS}
  with pytest.raises(ValueError, match="temperature=0.0"):
    grpo.token_logprobs(policy, rows, chunk_size=4, temperature=0.0)
