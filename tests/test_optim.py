"""Optimizer: schedule shape, weight-decay mask by name, clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtrain.config import default_config
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from jaxtrain.train.optim import learning_rate_schedule, make_optimizer, weight_decay_mask
from tests.helpers import mesh_of, small_config


def test_schedule_warms_up_then_decays_to_min():
  c = default_config()
  c.train.steps, c.optim.warmup_steps = 100, 10
  c.optim.learning_rate, c.optim.min_lr_ratio = 1.0, 0.1
  lr = learning_rate_schedule(c)
  np.testing.assert_allclose(float(lr(0)), 0.1, rtol=1e-6)  # first update is not wasted
  np.testing.assert_allclose(float(lr(9)), 1.0, rtol=1e-6)  # peak at the end of warmup
  assert float(lr(50)) < float(lr(20)) < 1.0
  np.testing.assert_allclose(float(lr(99)), 0.1, rtol=1e-5)  # last step at the minimum


def test_norm_scales_are_not_decayed_even_when_stacked():
  config = small_config()
  _, abstract_params, _ = abstract_model(ModelConfig.from_config(config), mesh_of((1, 1, 1)))
  mask = weight_decay_mask(abstract_params)
  flags = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
  assert any("norm" in k for k in flags)
  for key, decays in flags.items():
    assert decays == ("norm" not in key), key


def test_weight_decay_and_clipping_act():
  c = default_config()
  c.train.steps, c.optim.warmup_steps, c.optim.learning_rate = 10, 0, 0.1
  c.optim.weight_decay, c.optim.grad_clip_norm = 0.5, 1.0
  tx = make_optimizer(c)
  params = {"w": jnp.ones((4,)), "final_norm": {"scale": jnp.ones((4,))}}
  state = tx.init(params)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, state, params)
  assert float(updates["w"][0]) < 0  # decay pulls w toward 0 with zero gradient
  assert float(updates["final_norm"]["scale"][0]) == 0.0
  huge = jax.tree.map(lambda p: 1e6 * jnp.ones_like(p), params)
  clipped = optax.clip_by_global_norm(1.0).update(huge, optax.EmptyState())[0]
  np.testing.assert_allclose(float(optax.tree.norm(clipped)), 1.0, rtol=1e-5)
