"""Direct Preference Optimization: the sigmoid DPO loss of a policy against a frozen reference.

A batch holds, per side (chosen, rejected), `{side}_input_ids`, `{side}_attention_mask` and
`{side}_loss_mask`, each [B, T] and right-padded. The loss mask marks completion tokens at their
own positions: the log-probability of token t+1 (predicted at position t) counts when
`loss_mask[t+1]` is set. A sequence's log-probability is the sum over its completion tokens.

  loss = mean_b -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

with pi/ref the policy/reference sequence log-probs of the chosen (c) and rejected (r)
responses. The reference gets no gradient. Log-probs go through the chunked head
(`cross_entropy.sequence_cross_entropy`): no [B, T, V] logits are materialized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.ops.cross_entropy import sequence_cross_entropy

SIDES = ("chosen", "rejected")
BATCH_KEYS = tuple(f"{side}_{name}" for side in SIDES
                   for name in ("input_ids", "attention_mask", "loss_mask"))


def sequence_logprobs(model, input_ids_BT, attention_mask_BT, loss_mask_BT,
                      chunk_size: int = 512, dropout_key=None) -> jax.Array:
  """[B] float32: sum over t of log p(input_ids[t+1] | input_ids[:t+1]) where loss_mask[t+1]."""
  attention_mask_BT = attention_mask_BT.astype(jnp.int32)
  b, t = input_ids_BT.shape
  # Right padding: real tokens keep positions 0..n-1 and never see the padding (segment 0)
  # behind them, so a padded row computes exactly what the unpadded sequence would. Position t
  # predicts token t+1; the last position predicts nothing (weight 0). Tokens and their targets
  # travel together through the context layout (a no-op without a context axis).
  shift = lambda x_BT: jnp.concatenate([x_BT[:, 1:], jnp.zeros_like(x_BT[:, :1])], axis=1)
  rows = model.sequence_layout({
      "inputs": input_ids_BT, "segment_ids": attention_mask_BT,
      "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
      "targets": shift(input_ids_BT),
      "weights": shift((loss_mask_BT * attention_mask_BT).astype(jnp.float32))})
  kwargs = {} if dropout_key is None else {"dropout_key": dropout_key}  # LoRA dropout
  x_BTD = model.hidden_states(rows["inputs"], rows["positions"], rows["segment_ids"], **kwargs)
  w, vocab_axis = model.head()
  nll_B = sequence_cross_entropy(x_BTD, w, rows["targets"], rows["weights"], chunk_size,
                                 vocab_axis)
  return -nll_B


def _both_sides(model, batch, chunk_size, dropout_key=None):
  """(chosen [B], rejected [B]) log-probs from one forward pass over the 2B sequences."""
  stacked = {name: jnp.concatenate([batch[f"chosen_{name}"], batch[f"rejected_{name}"]])
             for name in ("input_ids", "attention_mask", "loss_mask")}
  logps_2B = sequence_logprobs(model, stacked["input_ids"], stacked["attention_mask"],
                               stacked["loss_mask"], chunk_size, dropout_key)
  return tuple(jnp.split(logps_2B, 2))


# Per-pair quantities whose batch means are DPO's metrics (sums over pairs, for accumulation).
METRIC_NAMES = ("chosen_rewards", "rejected_rewards", "reward_margin", "reward_accuracy",
                "policy_chosen_logps", "policy_rejected_logps")


def check_batch(batch):
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise KeyError(f"DPO batch lacks {missing}; it needs {list(BATCH_KEYS)}")


def reference_logprobs(reference_model, batch, *, chunk_size: int = 512):
  """(chosen [B], rejected [B]) sequence log-probs of the frozen reference, without gradient.

  The train step computes them before differentiating the policy: the reference needs no
  backward pass, and its (frozen) weights stay out of the differentiated function.
  """
  check_batch(batch)
  return jax.lax.stop_gradient(_both_sides(reference_model, batch, chunk_size))


def dpo_sums(policy_model, reference, batch, beta: float, *, chunk_size: int = 512,
             dropout_key=None):
  """(summed loss, pair count, {metric: sum over pairs}) of a batch of B pairs.

  `reference` is the reference model or its `reference_logprobs`. Sums rather than means, so
  microbatches of a gradient-accumulated step add up to exactly the full batch's numbers once
  divided by the total pair count.
  """
  check_batch(batch)
  policy_chosen_B, policy_rejected_B = _both_sides(policy_model, batch, chunk_size,
                                                   dropout_key)
  if not isinstance(reference, tuple):
    reference = reference_logprobs(reference, batch, chunk_size=chunk_size)
  ref_chosen_B, ref_rejected_B = reference
  chosen_rewards_B = beta * (policy_chosen_B - ref_chosen_B)
  rejected_rewards_B = beta * (policy_rejected_B - ref_rejected_B)
  margin_B = chosen_rewards_B - rejected_rewards_B
  per_pair = {
      "chosen_rewards": chosen_rewards_B,
      "rejected_rewards": rejected_rewards_B,
      "reward_margin": margin_B,
      "reward_accuracy": (margin_B > 0).astype(jnp.float32),
      "policy_chosen_logps": policy_chosen_B,
      "policy_rejected_logps": policy_rejected_B,
  }
  count = jnp.asarray(margin_B.shape[0], jnp.float32)
  return (-jnp.sum(jax.nn.log_sigmoid(margin_B)), count,
          {k: jnp.sum(v) for k, v in per_pair.items()})


def dpo_loss(policy_model, reference_model, batch, beta: float, *, chunk_size: int = 512):
  """(mean sigmoid DPO loss, metrics). Metrics are batch means: chosen/rejected rewards
  (beta * (policy - reference) log-probs), their margin, accuracy (the fraction of pairs whose
  chosen reward is the larger) and the policy's log-probs."""
  loss_sum, count, sums = dpo_sums(policy_model, reference_model, batch, beta,
                                   chunk_size=chunk_size)
  loss = loss_sum / count
  return loss, {"loss": loss, **{k: v / count for k, v in sums.items()}}
