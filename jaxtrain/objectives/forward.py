"""The model's forward pass as every objective's loss uses it: the model merged from its trained
weights and frozen base, its hidden states, the language-model loss sum, and the router's and
the multi-token-prediction modules' extra terms. Pure functions; the train step
(jaxtrain/train/step.py) differentiates what the objectives build from them."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxtrain.models import attention_stats, moe, mtp
from jaxtrain.ops import max_logit
from jaxtrain.ops.cross_entropy import chunked_cross_entropy

Batch = dict[str, jax.Array]


class Frozen(struct.PyTreeNode):
  """Weights a step reads but never updates: not in the optimizer, not in checkpoints (rebuilt
  from checkpoint.init_from on every start and resume)."""
  base: Any = None  # the rest of the model under LoRA (the quantized base under QLoRA)
  reference: Any = None  # DPO under full fine-tuning: the initial params, frozen


def merge_model(graphdef, params, frozen: Frozen | None = None):
  """The model from its trained weights and, under LoRA, its frozen base."""
  if frozen is None or frozen.base is None:
    return nnx.merge(graphdef, params)
  # Rebuilt leaf by leaf: NNX variables belong to the trace that made them, and the frozen
  # state arrives from outside the differentiated function (nnx.scan refuses such variables).
  return nnx.merge(graphdef, params, jax.tree.map(lambda x: x, frozen.base))


def _hidden_states(model, batch: Batch, dropout_key, *, predictions: bool = False):
  """model.hidden_states of the batch, or with `predictions` (multi-token prediction)
  model.hidden_states_with_predictions."""
  # The key is passed only when dropout is on, so models without it keep their signature.
  kwargs = {} if dropout_key is None else {"dropout_key": dropout_key}
  forward = model.hidden_states_with_predictions if predictions else model.hidden_states
  return forward(batch["inputs"], batch["positions"], batch["segment_ids"], **kwargs)


def router_terms(model, router_passes: list[dict], count, *, training: bool = True):
  """(loss sum to add, {metric: sum}) of an MoE model's router in the forward passes collected
  (models/moe.collect_router_stats), over `count` loss units: its auxiliary losses weighted by
  moe.aux_loss_coef / router_z_loss_coef (training only: evals report the objective's own
  loss) and its metrics, as sums so accumulation and evals divide them by the count like the
  loss. Nothing for a dense model."""
  if not router_passes:
    return 0.0, {}
  rt = model.cfg.runtime
  extra, metrics = moe.objective_terms(router_passes, rt.moe_aux_loss_coef, rt.moe_z_loss_coef,
                                       rt.moe_capacity_factor > 0, rt.moe_seq_aux_loss_coef)
  metrics = {k: v * count for k, v in metrics.items()}
  if training and model.cfg.arch.router_bias:
    # The bias balancing's input (make_train_step): only its sign per expert matters, so it
    # may be summed over microbatches and divided by the count like the metrics.
    metrics[moe.EXPERT_LOAD] = moe.expert_load(router_passes)
  return (extra * count if training else 0.0), metrics


def max_logit_terms(logit_passes: list) -> dict:
  """{attn_max_logit: the largest logit, HEAD_MAX_LOGITS: [L, H] per layer and head} of the
  forward passes' attention layers (models/attention_stats.collect_max_logits): maxima, which
  the train step combines over microbatches by max (train/step.MAX_METRICS). Nothing when the
  model does not track them."""
  if not logit_passes:
    return {}
  per_head_LH = functools.reduce(jnp.maximum, logit_passes)
  return {max_logit.MAX_LOGIT: jnp.max(per_head_LH), max_logit.HEAD_MAX_LOGITS: per_head_LH}


def loss_sum_fn(params, graphdef, batch: Batch, loss_chunk_size: int, frozen=None,
                dropout_key=None, *, training: bool = True):
  """(summed loss, token count, {metric: sum}) of a language-model batch under `params`; an MoE
  model's loss includes its router's auxiliary losses when `training`."""
  model = merge_model(graphdef, params, frozen)
  batch = model.sequence_layout(batch)
  with moe.collect_router_stats() as router_passes, \
       attention_stats.collect_max_logits() as logit_passes:
    if model.cfg.arch.mtp_depth:
      x_BTD, predictions = _hidden_states(model, batch, dropout_key, predictions=True)
    else:
      x_BTD, predictions = _hidden_states(model, batch, dropout_key), []
  w, vocab_axis = model.head()
  cross_entropy = functools.partial(
      chunked_cross_entropy, chunk_size=loss_chunk_size, vocab_axis=vocab_axis,
      explicit_transpose_for_dw=model.cfg.runtime.explicit_transpose_for_dw,
      in_fp8=model.cfg.runtime.fp8_head)
  loss_sum, count = cross_entropy(x_BTD, w, batch["targets"], batch["loss_mask"])
  extra, metrics = router_terms(model, router_passes, count, training=training)
  if training:
    metrics.update(max_logit_terms(logit_passes))
  if predictions:
    mtp_extra, mtp_metrics = mtp_terms(model, predictions, w, batch, cross_entropy, count)
    extra = extra + (mtp_extra if training else 0.0)
    metrics.update(mtp_metrics)
  return loss_sum + extra, count, metrics


def mtp_terms(model, predictions: list, w, batch: Batch, cross_entropy: Callable, count):
  """(loss sum to add, {metric: sum}) of the multi-token-prediction modules' states
  (models/mtp.py): depth k's mean cross-entropy against the targets k places on, within each
  document; mtp_loss_weight / D times their sum is added per loss unit (times `count`, so
  accumulation and evals divide it back like the loss), and their mean reported as mtp_loss."""
  means = []
  for k, h_BTD in enumerate(predictions, start=1):
    targets_BT, mask_BT = mtp.depth_targets(batch["targets"], batch["loss_mask"],
                                            batch["segment_ids"], k)
    depth_sum, depth_count = cross_entropy(h_BTD, w, targets_BT, mask_BT)
    means.append(depth_sum / jnp.maximum(depth_count, 1.0))
  weight = model.cfg.runtime.mtp_loss_weight / len(predictions)
  return weight * sum(means) * count, {"mtp_loss": sum(means) / len(means) * count}
