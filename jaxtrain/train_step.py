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
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from jaxtrain.cross_entropy import chunked_cross_entropy
from jaxtrain.mesh import batch_sharding, replicated, shard

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


class TrainState(struct.PyTreeNode):
  step: jax.Array
  params: Any  # nnx.State of the model's Params
  opt_state: optax.OptState
  bad_streak: jax.Array  # consecutive steps skipped for a non-finite loss or gradient


def loss_sum_fn(params, graphdef, batch: Batch, loss_chunk_size: int):
  """(summed loss, token count) of a batch under `params`."""
  model = nnx.merge(graphdef, params)
  x_BTD = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
  return chunked_cross_entropy(x_BTD, model.head_weights(), batch["targets"],
                               batch["loss_mask"], loss_chunk_size)


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
                 param_shardings=None) -> Callable:
  """`grad_fn(params, batch) -> (mean loss, token count, mean grads)` over the whole batch.

  With accumulation, microbatch losses and grads are summed (grads in float32) and divided by
  the batch's total token count once, which is exactly the full-batch mean. Grads are
  constrained to their params' shardings (when given) so data-parallel reductions become
  reduce-scatters into the shards, never replicated full gradients.
  """
  def constrain(grads):
    if param_shardings is None:
      return grads
    return jax.lax.with_sharding_constraint(grads, param_shardings)

  value_and_grad = jax.value_and_grad(loss_sum_fn, has_aux=True)

  def sum_grads(params, batch):
    (loss_sum, count), grads = value_and_grad(params, graphdef, batch, loss_chunk_size)
    return loss_sum, count, constrain(grads)

  def grad_fn(params, batch: Batch):
    if grad_accum_steps == 1:
      loss_sum, count, grads = sum_grads(params, batch)
    else:
      def accumulate(carry, mb):
        mb = {k: shard(v, ("act_batch", "act_length")) for k, v in mb.items()}
        loss_sum, count, grads = sum_grads(params, mb)
        acc_loss, acc_count, acc_grads = carry
        return (acc_loss + loss_sum, acc_count + count,
                jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)), None

      zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
      init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
      (loss_sum, count, grads), _ = jax.lax.scan(
          accumulate, init, _split_microbatches(batch, grad_accum_steps))
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    denom = jnp.maximum(count, 1.0)
    return loss_sum / denom, count, constrain(jax.tree.map(lambda g: g / denom, grads))

  return grad_fn


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, *,
                    grad_accum_steps: int = 1, loss_chunk_size: int = 512,
                    param_shardings=None) -> Callable:
  """Returns the pure `train_step(state, batch) -> (state, metrics)`."""
  grad_fn = make_grad_fn(graphdef, grad_accum_steps=grad_accum_steps,
                         loss_chunk_size=loss_chunk_size, param_shardings=param_shardings)

  def train_step(state: TrainState, batch: Batch):
    loss, count, grads = grad_fn(state.params, batch)
    grad_norm = optax.tree.norm(grads)
    # Optimizer state kept in host memory (optim.offload_state) is brought to the device for the
    # update, and the out_shardings send the new state back; for device-resident state this is a
    # no-op.
    old_opt_state = jax.device_put(state.opt_state, jax.memory.Space.Device)
    updates, opt_state = tx.update(grads, old_opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
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
    }
    return state.replace(step=state.step + 1, params=keep(params, state.params),
                         opt_state=keep(opt_state, old_opt_state),
                         bad_streak=bad_streak), metrics

  return train_step


def make_eval_step(graphdef, loss_chunk_size: int = 512) -> Callable:
  """`eval_step(params, batch) -> (loss_sum, token_count)`; sum over batches, then divide."""
  def eval_step(params, batch):
    return loss_sum_fn(params, graphdef, batch, loss_chunk_size)
  return eval_step


def opt_state_shardings(tx, abstract_params, param_shardings, mesh: Mesh):
  """Optimizer-state shardings: each param-shaped moment follows its param; scalars replicate.

  Param-shaped state goes to the memory kind the optimizer asks for (`state_memory_kind`, set by
  optim.HostStateTransformation to pinned_host), device memory otherwise.
  """
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  memory_kind = getattr(tx, "state_memory_kind", None)
  place = (lambda s: s) if memory_kind is None else (lambda s: s.with_memory_kind(memory_kind))
  return optax.tree_map_params(tx, lambda _, s: place(s), abstract_opt, param_shardings,
                               transform_non_params=lambda _: replicated(mesh))


def state_shardings(tx, abstract_params, param_shardings, mesh: Mesh) -> TrainState:
  return TrainState(step=replicated(mesh), params=param_shardings,
                    opt_state=opt_state_shardings(tx, abstract_params, param_shardings, mesh),
                    bad_streak=replicated(mesh))


def batch_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
  return {k: batch_sharding(mesh) for k in BATCH_KEYS}


def jit_train_step(train_step, shardings: TrainState, mesh: Mesh):
  """jit with explicit shardings; the state is donated so its buffers are updated in place."""
  metric_shardings = replicated(mesh)
  return jax.jit(train_step, in_shardings=(shardings, batch_shardings(mesh)),
                 out_shardings=(shardings, metric_shardings), donate_argnums=(0,))


def jit_eval_step(eval_step, param_shardings, mesh: Mesh):
  return jax.jit(eval_step, in_shardings=(param_shardings, batch_shardings(mesh)),
                 out_shardings=replicated(mesh))
