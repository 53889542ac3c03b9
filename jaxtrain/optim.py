"""The optimizer from config: AdamW, linear warmup + cosine decay, global-norm clipping.

Weight decay skips the RMSNorm scales (decaying them toward 0 would shrink every activation);
the mask is by parameter name, because with scanned layers a norm scale is 2-D ([L, D]) and a
rank rule would decay it.
"""

from __future__ import annotations

import jax
import optax


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
  """True for params that get weight decay: everything but normalization scales."""
  def decays(path, _):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return not any("norm" in n for n in names)
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config) -> optax.GradientTransformation:
  o = config.optim
  parts = []
  if o.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(o.grad_clip_norm))
  parts.append(optax.adamw(learning_rate_schedule(config), b1=o.b1, b2=o.b2, eps=o.eps,
                           weight_decay=o.weight_decay, mask=weight_decay_mask))
  return optax.chain(*parts)
