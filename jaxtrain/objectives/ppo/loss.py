"""PPO's math (proximal policy optimization, as RLHF uses it): token-level rewards with a KL
penalty to the reference, generalized advantage estimation, and the clipped policy and value
losses. Pure functions; the PPO objective and its rollouts use them.

Token arrays are [B, T] over completions in the training rows' layout
(jaxtrain.objectives.grpo.rollouts): the action at position t is the token predicted there
(targets[t]), `mask_BT` is 1 on the positions whose target is a completion token (one contiguous run
per row), and `values_BT[t]` is the value head's estimate at position t, i.e. of the state before
that action.

  reward   r_t = -β_kl · (log π_old(a_t) − log π_ref(a_t))  + R · [t is the row's last action]
  GAE      δ_t = r_t + γ · V_{t+1} − V_t  (V after the last action is 0),  A_t = δ_t + γλ · A_{t+1}
  returns  G_t = A_t + V_t
  policy   ρ_t = exp(log π(a_t) − log π_old(a_t)),  L_π = −min(ρ_t Â_t, clip(ρ_t, 1 ± ε) Â_t)
  value    V^clip_t = V_old_t + clip(V_t − V_old_t, ±ε_v),  L_V = ½ · max((V_t − G_t)², (V^clip_t − G_t)²)

with Â the advantages whitened over the rollout batch's action tokens, and every log π the
softmax of the logits / grpo.temperature, the distribution the rollouts were drawn from
(objectives.grpo.GRPO.policy_logprobs). Each sequence's loss is the masked token mean of
L_π + c_v · L_V, and the batch's the mean over sequences (the same sequence weighting as GRPO,
jaxtrain.objectives.grpo.loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Metrics ppo_sums returns as sums over sequences (divided by the count like the loss).
METRIC_NAMES = ("value_loss", "clip_fraction", "value_clip_fraction")


def token_rewards(sequence_reward_B, old_logprobs_BT, ref_logprobs_BT, mask_BT, kl_coef: float):
  """[B, T]: each action's KL penalty to the reference, plus the sequence's reward on its last
  action (nothing where the row has no action)."""
  mask_BT = mask_BT.astype(jnp.float32)
  penalty_BT = -kl_coef * (old_logprobs_BT - ref_logprobs_BT) * mask_BT
  t = mask_BT.shape[1]
  last_B = t - 1 - jnp.argmax(mask_BT[:, ::-1], axis=1)  # the last position with mask 1
  at_last_BT = (jnp.arange(t)[None, :] == last_B[:, None]) & (mask_BT.sum(axis=1) > 0)[:, None]
  return penalty_BT + jnp.where(at_last_BT, sequence_reward_B[:, None], 0.0)


def gae(rewards_BT, values_BT, mask_BT, gamma: float, lam: float):
  """(advantages [B, T], returns [B, T]) by generalized advantage estimation over each row's
  actions, last to first; 0 outside the actions."""
  mask_BT = mask_BT.astype(jnp.float32)
  values_BT = values_BT * mask_BT
  next_values_BT = jnp.concatenate([values_BT[:, 1:], jnp.zeros_like(values_BT[:, :1])], axis=1)
  delta_BT = (rewards_BT + gamma * next_values_BT - values_BT) * mask_BT

  def back(carry_B, xs):
    delta_B, m_B = xs
    a_B = (delta_B + gamma * lam * carry_B) * m_B
    return a_B, a_B
  _, adv_TB = jax.lax.scan(back, jnp.zeros_like(delta_BT[:, 0]),
                           (delta_BT.T, mask_BT.T), reverse=True)
  advantages_BT = adv_TB.T
  return advantages_BT, (advantages_BT + values_BT) * mask_BT


def masked_mean_var(x_BT, mask_BT):
  """(mean, variance) of x over the masked entries (the population variance)."""
  mask_BT = mask_BT.astype(jnp.float32)
  n = jnp.maximum(mask_BT.sum(), 1.0)
  mean = (x_BT * mask_BT).sum() / n
  return mean, (jnp.square(x_BT - mean) * mask_BT).sum() / n


def whiten(x_BT, mask_BT):
  """(x − mean) / (std + 1e-8) over the masked entries; 0 elsewhere."""
  mean, var = masked_mean_var(x_BT, mask_BT)
  return (x_BT - mean) / (jnp.sqrt(var) + 1e-8) * mask_BT.astype(jnp.float32)


def explained_variance(values_BT, returns_BT, mask_BT):
  """1 − Var(G − V) / Var(G) over the actions: 1 when the value head predicts the returns,
  0 when it predicts no better than their mean, negative when worse."""
  _, var_residual = masked_mean_var(returns_BT - values_BT, mask_BT)
  _, var_returns = masked_mean_var(returns_BT, mask_BT)
  return 1.0 - var_residual / jnp.maximum(var_returns, 1e-12)


def _sequence_means(x_BT, mask_BT):
  count_B = mask_BT.sum(axis=1)
  return (x_BT * mask_BT).sum(axis=1) / jnp.maximum(count_B, 1.0)


def ppo_sums(logprobs_BT, values_BT, old_logprobs_BT, old_values_BT, advantages_BT, returns_BT,
             mask_BT, *, epsilon: float = 0.2, value_clip: float = 0.2, vf_coef: float = 0.1):
  """(summed sequence losses, sequence count, {metric: summed sequence means}): sums over the
  batch's sequences, so microbatches add up to the whole batch. `advantages_BT` are the
  whitened ones."""
  mask_BT = mask_BT.astype(jnp.float32)
  ratio_BT = jnp.exp(logprobs_BT - old_logprobs_BT)
  unclipped_BT = ratio_BT * advantages_BT
  clipped_BT = jnp.clip(ratio_BT, 1.0 - epsilon, 1.0 + epsilon) * advantages_BT
  policy_BT = -jnp.minimum(unclipped_BT, clipped_BT)
  v_clipped_BT = old_values_BT + jnp.clip(values_BT - old_values_BT, -value_clip, value_clip)
  loss_plain_BT = jnp.square(values_BT - returns_BT)
  loss_clipped_BT = jnp.square(v_clipped_BT - returns_BT)
  value_BT = 0.5 * jnp.maximum(loss_plain_BT, loss_clipped_BT)
  count = jnp.asarray(logprobs_BT.shape[0], jnp.float32)
  metrics = {
      "value_loss": _sequence_means(value_BT, mask_BT).sum(),
      "clip_fraction": _sequence_means((clipped_BT < unclipped_BT).astype(jnp.float32),
                                       mask_BT).sum(),
      "value_clip_fraction": _sequence_means((loss_clipped_BT > loss_plain_BT).astype(
          jnp.float32), mask_BT).sum(),
  }
  return _sequence_means(policy_BT + vf_coef * value_BT, mask_BT).sum(), count, metrics
