"""The optimizer from config: AdamW or Muon (train/muon.py), linear warmup + cosine decay,
global-norm clipping.

Weight decay skips the RMSNorm scales (decaying them toward 0 would shrink every activation);
the mask is by parameter name, because with scanned layers a norm scale is 2-D ([L, D]) and a
rank rule would decay it.

Memory: the Adam moments are stored in `optim.state_dtype` (bfloat16 halves them) and, with
`optim.offload_state`, live in pinned host memory between steps. The optimizer carries that
placement as `state_memory_kind`, which `train_step.opt_state_shardings` reads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxtrain.models.moe import is_router_bias
from jaxtrain.train import muon


def learning_rate_schedule(config) -> optax.Schedule:
  """Learning rate of the update made at optimizer count c (0-based), i.e. of step c + 1.

  Shifted by one so the first update already has lr = peak / warmup_steps rather than 0 (an
  unshifted warmup from 0 wastes the first step).
  """
  o = config.optim
  decay_steps = o.decay_steps if o.decay_steps is not None else config.train.steps
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps,
      decay_steps=max(decay_steps, o.warmup_steps + 1),
      end_value=o.learning_rate * o.min_lr_ratio)
  return lambda count: base(count + 1)


def weight_decay_mask(params):
  """True for params that get weight decay: everything but normalization scales and router
  correction biases. The biases only choose experts, so their gradient is exactly zero and,
  without decay, Adam leaves them exactly as they are; the train step moves them
  (models/moe.balance_router_biases)."""
  def decays(path, _):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return not any("norm" in n for n in names) and not is_router_bias(path)
  return jax.tree_util.tree_map_with_path(decays, params)


def scale_by_adam(b1: float, b2: float, eps: float,
                  state_dtype: Any = jnp.float32) -> optax.GradientTransformation:
  """Adam's update direction with both moments stored in `state_dtype`.

  optax.scale_by_adam can narrow only the first moment. Here the moments are read, updated and
  bias-corrected in float32 and rounded to `state_dtype` only when stored, so a float32 state
  gives optax's numbers. The state is optax's ScaleByAdamState (count, mu, nu), so checkpoints
  keep their tree paths.
  """
  state_dtype = jnp.dtype(state_dtype)

  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, state_dtype)
    return optax.ScaleByAdamState(count=jnp.zeros((), jnp.int32), mu=jax.tree.map(zeros, params),
                                  nu=jax.tree.map(zeros, params))

  def update(grads, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    c = count.astype(jnp.float32)

    def moments(g, mu, nu):
      g32 = g.astype(jnp.float32)
      mu32 = b1 * mu.astype(jnp.float32) + (1.0 - b1) * g32
      nu32 = b2 * nu.astype(jnp.float32) + (1.0 - b2) * (g32 * g32)
      mu_hat, nu_hat = mu32 / (1.0 - b1 ** c), nu32 / (1.0 - b2 ** c)
      step = (mu_hat / (jnp.sqrt(nu_hat) + eps)).astype(g.dtype)
      return step, mu32.astype(state_dtype), nu32.astype(state_dtype)

    out = jax.tree.map(moments, grads, state.mu, state.nu)
    # (an optax.MaskedNode, a leaf multi_transform gave the other optimizer, is a tuple too)
    is_out = lambda x: isinstance(x, tuple) and not isinstance(x, optax.MaskedNode)
    pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=is_out)
    return pick(0), optax.ScaleByAdamState(count=count, mu=pick(1), nu=pick(2))

  return optax.GradientTransformation(init, update)


class HostStateTransformation(optax.GradientTransformation):
  """An optimizer whose state lives in pinned host memory between steps.

  The same (init, update) pair; only `state_memory_kind` differs, and `opt_state_shardings`
  gives the param-shaped state that memory kind. The jitted train step brings the state to the
  device for the update and its out_shardings send the new state back, so the device holds it
  only transiently. Needs a backend with pinned_host memory (config_checks.validate checks).
  """
  state_memory_kind = "pinned_host"


def make_optimizer(config, param_shardings=None) -> optax.GradientTransformation:
  """clip -> AdamW (moments in optim.state_dtype), or Muon for the projection matrices and AdamW
  for the rest (optim.name="muon"; `param_shardings` lets Muon orthogonalize whole matrices
  without gathering a stack: train/muon.py), optionally with host-resident state.

  The AdamW chain is optax.adamw's (scale_by_adam, masked weight decay, -lr), nested the same
  way, so the optimizer state's tree is unchanged from earlier checkpoints.
  """
  o = config.optim
  parts = []
  if o.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(o.grad_clip_norm))
  direction = scale_by_adam(o.b1, o.b2, o.eps, state_dtype=o.state_dtype)
  if o.name == "muon":
    # Muon for the projection matrices, AdamW's direction for the rest; decay and learning rate
    # are shared (Muon's update is scaled to AdamW's RMS: muon.update_scale).
    m = o.muon
    direction = optax.multi_transform(
        {"muon": muon.scale_by_muon(m.momentum, m.ns_steps, m.adjust_lr, m.nesterov,
                                    state_dtype=o.state_dtype,
                                    param_shardings=param_shardings),
         "adamw": direction}, muon.labels)
  parts.append(optax.chain(
      direction,
      optax.add_decayed_weights(o.weight_decay, mask=weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate_schedule(config))))
  tx = optax.chain(*parts)
  if o.offload_state:
    return HostStateTransformation(tx.init, tx.update)
  return tx
