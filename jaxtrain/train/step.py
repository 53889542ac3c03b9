"""The pure train and eval steps, and their sharded jit compilation. No I/O here.

A batch is a dict of [B, T] arrays: `inputs`, `targets` (int32), `loss_mask` (float32, 0 on
padding and on tokens that should not be learned), `segment_ids` (0 = padding) and `positions`.
The loss is the mean next-token cross-entropy over loss-mask tokens of the whole global batch,
so gradient accumulation over microbatches gives the same update as one full batch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding

from jaxtrain import objectives
from jaxtrain.data.pipeline import BATCH_KEYS  # the language-model batch (module docstring)
from jaxtrain.models import moe
from jaxtrain.objectives.forward import Frozen
from jaxtrain.objectives.grpo.loss import LOGPROB_MISMATCH
from jaxtrain.ops import max_logit
from jaxtrain.parallel.mesh import batch_sharding, replicated, shard
from jaxtrain.parallel.pipeline import stage_count
from jaxtrain.train.qk_clip import qk_clip

Batch = dict[str, jax.Array]

# Metrics a loss returns as a largest value over its rows rather than a sum over its units: the
# step takes their max over accumulation microbatches and does not divide them by the count
# (over devices the max over the global batch already is one). -inf: nothing to measure (the
# loop leaves them out of the log record).
MAX_METRICS = frozenset({LOGPROB_MISMATCH, max_logit.MAX_LOGIT, max_logit.HEAD_MAX_LOGITS})


def _combine_metrics(acc: dict, new: dict) -> dict:
  """Accumulated metrics plus a microbatch's: sums, MAX_METRICS by max."""
  return {k: (jnp.maximum if k in MAX_METRICS else jnp.add)(acc[k], v) for k, v in new.items()}


class TrainState(struct.PyTreeNode):
  step: jax.Array
  params: Any  # the trained weights: the model's Params, or only its LoRA adapters
  opt_state: optax.OptState
  bad_streak: jax.Array  # consecutive steps skipped for a non-finite loss or gradient
  frozen: Frozen | None = None


def make_loss_sums(graphdef, *, objective="lm", loss_chunk_size: int = 512,
                   dpo_beta: float = 0.1, training: bool = True) -> tuple[Callable, Callable]:
  """(`constants(params, frozen, batch)`, `loss_sums(params, frozen, batch, constants,
  dropout_key) -> (loss sum, count, {metric: sum})`) of `objective` (an Objective, or its name
  with `dpo_beta` for "dpo"): see jaxtrain.objectives.base.Objective.loss_sums."""
  return objectives.get(objective, dpo_beta=dpo_beta).loss_sums(graphdef, loss_chunk_size,
                                                                training=training)


def _split_microbatches(batch: Batch, steps: int) -> Batch:
  """[B, ...] -> [steps, B/steps, ...], microbatch i = rows i, i+steps, ...

  Strided rather than contiguous, so every microbatch has rows on every data-parallel device
  (each device's contiguous block of rows holds a share of every microbatch).
  """
  def split(x):
    x = x.reshape(x.shape[0] // steps, steps, *x.shape[1:]).swapaxes(0, 1)
    return x
  return jax.tree.map(split, batch)


def make_grad_fn(graphdef, *, grad_accum_steps: int = 1, loss_chunk_size: int = 512,
                 param_shardings=None, objective: str = "lm", dpo_beta: float = 0.1,
                 with_aux: bool = False) -> Callable:
  """`grad_fn(params, batch, frozen=None, dropout_key=None) -> (mean loss, count, mean grads)`
  over the whole batch (with `with_aux`, a fourth item: the objective's metrics as batch means,
  MAX_METRICS as batch maxima).

  With accumulation, microbatch losses and grads are summed (grads in float32) and divided by
  the batch's total count (tokens, or pairs for DPO) once, which is exactly the full-batch
  mean. Grads are constrained to their params' shardings (when given) so data-parallel
  reductions become reduce-scatters into the shards, never replicated full gradients.
  """
  def constrain(grads):
    if param_shardings is None:
      return grads
    return jax.lax.with_sharding_constraint(grads, param_shardings)

  constants_fn, loss_sums = make_loss_sums(graphdef, objective=objective,
                                           loss_chunk_size=loss_chunk_size, dpo_beta=dpo_beta)

  def value_and_grad(params, frozen, batch, key):
    constants_fn_, loss_sums_ = constants_fn, loss_sums
    if stage_count() > 1:
      # Under pipeline stages the loss sees the whole batch (grad_accum_steps microbatches) at
      # once: chunks of loss_chunk_size/grad_accum_steps positions hold the logits that one
      # accumulation microbatch's chunk would.
      constants_fn_, loss_sums_ = make_loss_sums(
          graphdef, objective=objective, dpo_beta=dpo_beta,
          loss_chunk_size=max(1, loss_chunk_size // grad_accum_steps))
    constants = constants_fn_(params, frozen, batch)

    def loss(p):
      loss_sum, count, aux = loss_sums_(p, frozen, batch, constants, key)
      return loss_sum, (count, aux)
    (loss_sum, (count, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return loss_sum, count, aux, constrain(grads)

  def grad_fn(params, batch: Batch, frozen=None, dropout_key=None):
    # Under pipeline stages the step is one pipeline pass whose microbatches (a multiple of
    # grad_accum_steps, config_checks) already split the batch: no accumulation loop on top.
    if grad_accum_steps == 1 or stage_count() > 1:
      loss_sum, count, aux, grads = value_and_grad(params, frozen, batch, dropout_key)
    else:
      def accumulate(carry, xs):
        i, mb = xs
        mb = {k: shard(v, ("act_batch", "act_length")[:v.ndim]) for k, v in mb.items()}
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
        # Params and frozen weights ride in the carry, unchanged: NNX refuses to merge a model
        # (the DPO reference) from tracers of the trace outside the scan.
        (params_, frozen_), acc_loss, acc_count, acc_aux, acc_grads = carry
        loss_sum, count, aux, grads = value_and_grad(params_, frozen_, mb, key)
        return ((params_, frozen_), acc_loss + loss_sum, acc_count + count,
                _combine_metrics(acc_aux, aux),
                jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)), None

      zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
      first = _split_microbatches(batch, grad_accum_steps)
      # Traced values go in as arguments: NNX refuses to merge tracers of an outer trace.
      aux_shapes = jax.eval_shape(
          lambda p, f, b: loss_sums(p, f, b, constants_fn(p, f, b), None)[2], params, frozen,
          jax.tree.map(lambda x: x[0], first))
      zero_aux = {k: jnp.full(s.shape, -jnp.inf if k in MAX_METRICS else 0, s.dtype)
                  for k, s in aux_shapes.items()}
      init = ((params, frozen), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
              zero_aux, zeros)
      (_, loss_sum, count, aux, grads), _ = jax.lax.scan(
          accumulate, init, (jnp.arange(grad_accum_steps), first))
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    denom = jnp.maximum(count, 1.0)
    grads = constrain(jax.tree.map(lambda g: g / denom, grads))
    if with_aux:
      return loss_sum / denom, count, grads, {k: v if k in MAX_METRICS else v / denom
                                              for k, v in aux.items()}
    return loss_sum / denom, count, grads

  return grad_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, *,
                    grad_accum_steps: int = 1, loss_chunk_size: int = 512,
                    param_shardings=None, objective: str = "lm", dpo_beta: float = 0.1,
                    dropout_seed: int | None = None,
                    bias_update_rate: float = 0.0, qk_clip_threshold: float = 0.0,
                    rope_head_dim: int = 0) -> Callable:
  """Returns the pure `train_step(state, batch) -> (state, metrics)`.

  `dropout_seed` (LoRA dropout): each step's key is the seed folded with the step number, so a
  resumed run draws the same masks as an uninterrupted one.

  `bias_update_rate` (moe.bias_update_rate; DeepSeek's routers when their biases train): after
  the update, each router bias moves against its experts' load error in this step's batch
  (models/moe.balance_router_biases). The optimizer leaves them as they are: their gradient
  is zero (they only choose experts) and weight decay skips them (optim.weight_decay_mask).

  `qk_clip_threshold` (optim.muon.qk_clip_threshold; 0: off): after the update, the query and
  key weights of every attention head whose largest logit in this step's batch passed it are
  scaled back to it (train/qk_clip.py; `rope_head_dim`: latent attention's rotary part).
  """
  grad_fn = make_grad_fn(graphdef, grad_accum_steps=grad_accum_steps,
                         loss_chunk_size=loss_chunk_size, param_shardings=param_shardings,
                         objective=objective, dpo_beta=dpo_beta, with_aux=True)

  def train_step(state: TrainState, batch: Batch):
    key = None
    if dropout_seed is not None:
      key = jax.random.fold_in(jax.random.key(dropout_seed), state.step)
    loss, count, grads, aux = grad_fn(state.params, batch, state.frozen, key)
    load_LX = aux.pop(moe.EXPERT_LOAD, None)
    max_logit_LH = aux.pop(max_logit.HEAD_MAX_LOGITS, None)
    grad_norm = optax.tree.norm(grads)
    # Optimizer state kept in host memory (optim.offload_state) is brought to the device for the
    # update, and the out_shardings send the new state back; for device-resident state this is a
    # no-op.
    old_opt_state = jax.device_put(state.opt_state, jax.memory.Space.Device)
    updates, opt_state = tx.update(grads, old_opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if load_LX is not None and bias_update_rate > 0:
      params = moe.balance_router_biases(params, load_LX, bias_update_rate)
    if max_logit_LH is not None and qk_clip_threshold > 0:
      params = qk_clip(params, max_logit_LH, qk_clip_threshold, rope_head_dim)
    # A NaN/Inf loss or gradient skips the update (params and optimizer state unchanged) rather
    # than poisoning the weights; the trainer stops after too many in a row.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    bad_streak = jnp.where(finite, 0, state.bad_streak + 1)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "learning_rate": schedule(state.step),
        "tokens": count,
        "skipped": 1.0 - finite.astype(jnp.float32),
        "bad_streak": bad_streak,
        **aux,
    }
    return state.replace(step=state.step + 1, params=keep(params, state.params),
                         opt_state=keep(opt_state, old_opt_state),
                         bad_streak=bad_streak), metrics

  return train_step


def make_eval_step(graphdef, loss_chunk_size: int = 512, *, objective: str = "lm",
                   dpo_beta: float = 0.1) -> Callable:
  """`eval_step(params, batch, frozen=None) -> (loss sum, count, {metric: sum})`; sum over
  batches, then divide by the summed count."""
  constants_fn, loss_sums = make_loss_sums(graphdef, objective=objective,
                                           loss_chunk_size=loss_chunk_size, dpo_beta=dpo_beta,
                                           training=False)

  def eval_step(params, batch, frozen=None):
    return loss_sums(params, frozen, batch, constants_fn(params, frozen, batch), None)
  return eval_step


def opt_state_shardings(tx, abstract_params, param_shardings, mesh: Mesh):
  """Optimizer-state shardings: each param-shaped moment follows its param; scalars replicate.

  Param-shaped state goes to the memory kind the optimizer asks for (`state_memory_kind`, set by
  optim.HostStateTransformation to pinned_host), device memory otherwise.
  """
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  memory_kind = getattr(tx, "state_memory_kind", None)
  place = (lambda s: s) if memory_kind is None else (lambda s: s.with_memory_kind(memory_kind))
  # A param-shaped state of optax.multi_transform (optim.name=muon) holds a MaskedNode where the
  # other optimizer has the param: it stays a MaskedNode (no array, no sharding).
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return optax.tree_map_params(tx, lambda x, s: x if masked(x) else place(s), abstract_opt,
                               param_shardings, transform_non_params=lambda _: replicated(mesh),
                               is_leaf=masked)


def state_shardings(tx, abstract_params, param_shardings, mesh: Mesh,
                    frozen_shardings: Frozen | None = None) -> TrainState:
  return TrainState(step=replicated(mesh), params=param_shardings,
                    opt_state=opt_state_shardings(tx, abstract_params, param_shardings, mesh),
                    bad_streak=replicated(mesh), frozen=frozen_shardings)


def batch_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
  return {k: batch_sharding(mesh) for k in BATCH_KEYS}


def jit_train_step(train_step, shardings: TrainState, mesh: Mesh, batch_shardings=None):
  """jit with explicit shardings; the state is donated so its buffers are updated in place (the
  frozen weights pass through unchanged, aliased rather than copied).

  `batch_shardings` ({key: sharding}, Objective.batch_shardings) defaults to every array being
  [B, T] split over the data-parallel axes.
  """
  metric_shardings = replicated(mesh)
  batch_in = batch_sharding(mesh) if batch_shardings is None else batch_shardings
  return jax.jit(train_step, in_shardings=(shardings, batch_in),
                 out_shardings=(shardings, metric_shardings), donate_argnums=(0,))


def jit_eval_step(eval_step, param_shardings, mesh: Mesh, frozen_shardings=None,
                  batch_shardings=None):
  batch_in = batch_sharding(mesh) if batch_shardings is None else batch_shardings
  return jax.jit(eval_step, in_shardings=(param_shardings, batch_in, frozen_shardings),
                 out_shardings=replicated(mesh))
