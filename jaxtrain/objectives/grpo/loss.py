"""GRPO's math (group relative policy optimization): group-relative advantages and the clipped,
KL-penalized policy loss. Pure functions; the objective and the rollouts use them.

Shapes: rewards and advantages are per completion, [N·G] with each run of G consecutive entries
one prompt's group; token arrays are [B, T] over completions (B = N·G), `mask_BT` 1 on the
completion tokens whose log-probs count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.ops.cross_entropy import token_cross_entropy

# The training batch built from a batch of rollouts (jaxtrain.objectives.grpo.rollouts): the
# language-model keys ([B, T]; loss_mask 1 on completion targets) and each completion's advantage
# [B]; with grpo.num_iterations > 1 also the sampling policy's per-token log-probs [B, T] as the
# trainer computes them (OLD_LOGPROBS, right after sampling).
TOKEN_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")
OLD_LOGPROBS = "old_logprobs"
# The sampler's own log-prob of each generated token [B, T] under the tempered softmax it drew
# from (before top-p; jaxtrain.generate.sampler.sample_continuations, with_logprobs), recorded in
# the decode loop and aligned like OLD_LOGPROBS by
# jaxtrain.objectives.grpo.rollouts.training_rows: position t holds log p(targets[t]), NaN where no
# token was sampled (prompt, padding, a warm-up's reference completion). Any objective trained on
# sampled rollouts (GRPO; PPO later) carries it and reports LOGPROB_MISMATCH.
SAMPLER_LOGPROBS = "sampler_logprobs"
# With grpo.replay_routing (an MoE policy): each row's experts as the rollout's forward pass
# chose them, [B, T, num_layers, k] int32, -1 where nothing was recorded (the prompt's padding,
# a warm-up's reference completion: those tokens choose their own). The policy's forward passes
# over the row replay them (token_logprobs); the reference's do not (it is another model).
ROUTING = "routing"
LOGPROB_MISMATCH = "logprob_mismatch"

# Metrics grpo_sums returns as sums over sequences (divided by the count like the loss).
METRIC_NAMES = ("kl", "clip_fraction")


def group_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
  """(r - mean of its group) / (std of its group + 1e-6), the standard deviation unbiased
  (ddof=1); a group whose rewards are all equal gets 0 (it carries no signal)."""
  if group_size < 2:
    raise ValueError(f"group_size={group_size}: GRPO needs at least 2 completions per prompt")
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1 or rewards.shape[0] % group_size:
    raise ValueError(f"rewards of shape {rewards.shape}: expected [N*{group_size}] (each prompt's "
                     f"{group_size} completions consecutive)")
  r_NG = rewards.reshape(-1, group_size)
  mean_N1 = r_NG.mean(axis=1, keepdims=True)
  std_N1 = r_NG.std(axis=1, ddof=1, keepdims=True)
  equal_N1 = jnp.all(r_NG == r_NG[:, :1], axis=1, keepdims=True)
  return jnp.where(equal_N1, 0.0, (r_NG - mean_N1) / (std_N1 + 1e-6)).reshape(-1)


def _token_terms(logprobs_BT, old_logprobs_BT, ref_logprobs_BT, advantages_B, epsilon, beta):
  """(token loss, KL term, clipped flag), each [B, T]."""
  ratio_BT = jnp.exp(logprobs_BT - old_logprobs_BT)
  a_B1 = advantages_B[:, None]
  unclipped_BT = ratio_BT * a_B1
  clipped_BT = jnp.clip(ratio_BT, 1.0 - epsilon, 1.0 + epsilon) * a_B1
  # k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - policy, >= 0.
  d_BT = ref_logprobs_BT - logprobs_BT
  kl_BT = jnp.exp(d_BT) - d_BT - 1.0
  loss_BT = -jnp.minimum(unclipped_BT, clipped_BT) + beta * kl_BT
  # Clipped: the min took the clipped term and it differs (the ratio left the trust region in
  # the direction the advantage pushes).
  clip_BT = (clipped_BT < unclipped_BT).astype(jnp.float32)
  return loss_BT, kl_BT, clip_BT


def _sequence_means(x_BT, mask_BT):
  """Each sequence's masked token mean [B] (0 for a sequence without completion tokens)."""
  count_B = mask_BT.sum(axis=1)
  return (x_BT * mask_BT).sum(axis=1) / jnp.maximum(count_B, 1.0)


def grpo_sums(logprobs_BT, old_logprobs_BT, ref_logprobs_BT, advantages_B, mask_BT, *,
              epsilon: float = 0.2, beta: float = 0.04):
  """(summed sequence losses, sequence count, {metric: summed sequence means}): sums over the
  batch's sequences, so microbatches add up to the whole batch and one division gives
  `grpo_loss`."""
  mask_BT = mask_BT.astype(jnp.float32)
  loss_BT, kl_BT, clip_BT = _token_terms(logprobs_BT, old_logprobs_BT, ref_logprobs_BT,
                                         advantages_B, epsilon, beta)
  count = jnp.asarray(logprobs_BT.shape[0], jnp.float32)
  metrics = {"kl": _sequence_means(kl_BT, mask_BT).sum(),
             "clip_fraction": _sequence_means(clip_BT, mask_BT).sum()}
  return _sequence_means(loss_BT, mask_BT).sum(), count, metrics


def logprob_mismatch(trainer_logprobs_BT, sampler_logprobs_BT, mask_BT) -> jax.Array:
  """max |trainer - sampler| over the tokens of `mask_BT` that were sampled (their sampler
  log-prob is not NaN): how far the log-probs the sampler drew with are from the ones the
  trainer computes for the same tokens and weights (a different program: cached decode vs the
  training forward, possibly other kernels and precisions). -inf when no token counts (a
  warm-up batch). A max, not a sum: the train step reduces it by max over microbatches
  (train_step.MAX_METRICS), and over devices as a max over the global batch. No gradient."""
  trainer_BT = jax.lax.stop_gradient(trainer_logprobs_BT.astype(jnp.float32))
  sampler_BT = sampler_logprobs_BT.astype(jnp.float32)
  counts_BT = (mask_BT > 0) & ~jnp.isnan(sampler_BT)
  diff_BT = jnp.abs(trainer_BT - jnp.where(counts_BT, sampler_BT, 0.0))
  return jnp.max(jnp.where(counts_BT, diff_BT, -jnp.inf))


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, epsilon: float = 0.2,
              beta: float = 0.04):
  """(loss, metrics). ratio = exp(logprobs - old_logprobs); token loss = -min(ratio·A,
  clip(ratio, 1-ε, 1+ε)·A) + β·(exp(ref - logprobs) - (ref - logprobs) - 1); each sequence's
  loss is its masked token mean, and the loss is the mean over sequences. `metrics`: `kl` (the
  same means of the KL term) and `clip_fraction` (of tokens whose clipped term was taken)."""
  total, count, sums = grpo_sums(logprobs, old_logprobs, ref_logprobs, advantages, mask,
                                 epsilon=epsilon, beta=beta)
  return total / count, {k: v / count for k, v in sums.items()}


def token_logprobs(model, batch, *, chunk_size: int = 512, dropout_key=None,
                   vocab_limit: int | None = None, temperature: float = 1.0,
                   with_values: bool = False):
  """[B, T] float32 log p(targets[t] | inputs[:t+1]) under `model`, for a batch already in the
  model's sequence layout (`model.sequence_layout`). Padding positions hold garbage that the
  loss mask removes.

  `vocab_limit`: the policy is the softmax over the ids below it, the tokenizer's real
  vocabulary that the rollouts draw from. Over a padded vocabulary instead, training could move
  probability onto ids no rollout ever draws, which lowers every sampled token's log-prob
  without changing what is sampled: the KL estimates and the importance ratios would then
  reward it. `temperature`: the softmax of logits / temperature, the distribution the rollouts
  were drawn from (grpo.temperature; objectives.grpo.GRPO.policy_logprobs passes it), so the
  ratio and the policy gradient are of the policy that sampled. `with_values`: (log-probs, the
  value head's values [B, T]) from the same pass (PPO)."""
  if not temperature > 0:  # greedy decoding (0) has no distribution to train
    raise ValueError(f"temperature={temperature}: log-probs need a temperature > 0")
  kwargs = {} if dropout_key is None else {"dropout_key": dropout_key}  # LoRA dropout
  if batch.get(ROUTING) is not None:  # the rollout's experts, replayed (ROUTING above)
    kwargs["routing_LBTK"] = jnp.moveaxis(batch[ROUTING], 2, 0)
  x_BTD = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"], **kwargs)
  w, vocab_axis = model.head()
  logprobs_BT = -token_cross_entropy(x_BTD, w, batch["targets"], chunk_size, vocab_axis,
                                     vocab_limit, temperature)
  return (logprobs_BT, model.values(x_BTD)) if with_values else logprobs_BT


def without_routing(batch):
  """The batch without the rollout's routing: for the reference, which routes for itself."""
  return {k: v for k, v in batch.items() if k != ROUTING}


def in_layout(model, batch):
  """The batch's per-token arrays in the model's sequence layout; per-sequence ones unchanged."""
  tokens = {k: v for k, v in batch.items() if v.ndim == 2}
  return {**batch, **model.sequence_layout(tokens)}
