"""Reward models: the score head's value at a sequence's last real token is its reward, trained
on preference pairs with the Bradley-Terry loss

  loss = mean_b  -log sigmoid(r_chosen - r_rejected - margin)  +  c * (r_chosen + r_rejected)^2

`margin` asks the chosen reward to beat the rejected one by that much before the loss rests; the
centering term (coefficient c, off by default) keeps the rewards near zero, which the loss alone
leaves free (it sees only differences). The batch is the DPO one
(`jaxtrain.objectives.dpo.loss.BATCH_KEYS`, right-padded {side}_input_ids and {side}_attention_mask;
the loss masks are not read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.parallel import context_parallel

SIDES = ("chosen", "rejected")
BATCH_KEYS = tuple(f"{side}_{name}" for side in SIDES for name in ("input_ids", "attention_mask"))
# Per-pair quantities whose batch means are the metrics (sums over pairs, for accumulation).
METRIC_NAMES = ("accuracy", "margin_mean", "reward_chosen_mean", "reward_rejected_mean")


def last_token_scores(scores_BT: jax.Array, attention_mask_BT: jax.Array) -> jax.Array:
  """[B]: each right-padded row's score at its last real token (position 0 for an empty row)."""
  last_B = jnp.maximum(jnp.sum(attention_mask_BT.astype(jnp.int32), axis=-1) - 1, 0)
  return jnp.take_along_axis(scores_BT, last_B[:, None], axis=-1)[:, 0]


def sequence_rewards(model, input_ids_BT, attention_mask_BT, dropout_key=None) -> jax.Array:
  """[B] float32: the reward of each right-padded sequence."""
  attention_mask_BT = attention_mask_BT.astype(jnp.int32)
  b, t = input_ids_BT.shape
  # Right padding: real tokens keep positions 0..n-1 and never see the padding (segment 0), so
  # a padded row scores what the unpadded sequence would.
  rows = model.sequence_layout({
      "inputs": input_ids_BT, "segment_ids": attention_mask_BT,
      "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))})
  kwargs = {} if dropout_key is None else {"dropout_key": dropout_key}  # LoRA dropout
  x_BTD = model.hidden_states(rows["inputs"], rows["positions"], rows["segment_ids"], **kwargs)
  scores_BT = context_parallel.from_layout(model.scores(x_BTD), context_parallel.context_size(),
                                           model.cfg.parallel.context_load_balance)
  return last_token_scores(scores_BT, attention_mask_BT)


def check_batch(batch):
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise KeyError(f"reward-model batch lacks {missing}; it needs {list(BATCH_KEYS)}")


def pair_terms(chosen_B, rejected_B, *, margin: float = 0.0, center_coef: float = 0.0):
  """(per-pair loss [B], {metric: per-pair value [B]}) from the two sides' rewards."""
  diff_B = chosen_B - rejected_B
  loss_B = -jax.nn.log_sigmoid(diff_B - margin)
  if center_coef:
    loss_B = loss_B + center_coef * jnp.square(chosen_B + rejected_B)
  return loss_B, {"accuracy": (diff_B > 0).astype(jnp.float32), "margin_mean": diff_B,
                  "reward_chosen_mean": chosen_B, "reward_rejected_mean": rejected_B}


def reward_sums(model, batch, *, margin: float = 0.0, center_coef: float = 0.0,
                dropout_key=None):
  """(summed loss, pair count, {metric: sum over pairs}) of a batch of B pairs: sums, so the
  microbatches of an accumulated step add up to the full batch's numbers. Both sides go through
  one forward pass over the 2B sequences."""
  check_batch(batch)
  ids = jnp.concatenate([batch["chosen_input_ids"], batch["rejected_input_ids"]])
  mask = jnp.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
  chosen_B, rejected_B = jnp.split(sequence_rewards(model, ids, mask, dropout_key), 2)
  loss_B, per_pair = pair_terms(chosen_B, rejected_B, margin=margin, center_coef=center_coef)
  count = jnp.asarray(loss_B.shape[0], jnp.float32)
  return jnp.sum(loss_B), count, {k: jnp.sum(v) for k, v in per_pair.items()}
