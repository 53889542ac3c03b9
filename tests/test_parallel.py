"""Same loss and gradients on every mesh; gradient accumulation equals the full batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import train_setup, trainer
from jaxtrain.model import ModelConfig
from jaxtrain.sharding import abstract_model, init_params
from jaxtrain.train_step import make_grad_fn
from tests.helpers import mesh_of, packed_batch, small_config

# The last: pipeline stages (2 microbatches, the default for 2 stages) against the plain scan.
MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4),
          {"stage": 2, "fsdp": 2, "tensor": 2}]


def _loss_and_grads(config, mesh_shape, batch, grad_accum_steps=1):
  mesh = mesh_of(mesh_shape)
  cfg = ModelConfig.from_config(config)
  graphdef, params = init_params(cfg, mesh, seed=0)
  _, _, shardings = abstract_model(cfg, mesh)
  grad_fn = jax.jit(make_grad_fn(graphdef, grad_accum_steps=grad_accum_steps,
                                 loss_chunk_size=config.train.loss_chunk_size,
                                 param_shardings=shardings))
  with jax.set_mesh(mesh):
    loss, count, grads = grad_fn(params, trainer.to_global_batch(batch, mesh))
  return float(loss), float(count), jax.device_get(nnx.to_pure_dict(grads)), grads


@pytest.fixture(scope="module")
def reference():
  config = small_config()
  batch = packed_batch(8, 32, 128)
  return config, batch, _loss_and_grads(config, (1, 1, 1), batch)


@pytest.mark.parametrize("mesh_shape", MESHES[1:])
def test_same_loss_and_grads_on_every_mesh(reference, mesh_shape):
  config, batch, (ref_loss, ref_count, ref_grads, _) = reference
  loss, count, grads, sharded = _loss_and_grads(config, mesh_shape, batch)
  assert count == ref_count
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
  for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
  # The gradients really are sharded as their params (not silently replicated).
  _, _, shardings = abstract_model(ModelConfig.from_config(config), mesh_of(mesh_shape))
  for g, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(shardings)):
    assert g.sharding.is_equivalent_to(s, g.ndim)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 2, 2)])
def test_grad_accumulation_equals_full_batch(reference, mesh_shape):
  config, batch, (ref_loss, ref_count, ref_grads, _) = reference
  loss, count, grads, _ = _loss_and_grads(config, mesh_shape, batch, grad_accum_steps=4)
  assert count == ref_count
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-4)


def test_accumulation_weights_microbatches_by_tokens():
  """Microbatches with different token counts: the mean is over tokens, not over microbatches."""
  config = small_config()
  batch = packed_batch(8, 32, 128, seed=3)
  batch["loss_mask"][::4, 8:] = 0.0  # rows 0 and 4: microbatch 0 of 4 has far fewer tokens
  full = _loss_and_grads(config, (1, 1, 1), batch)
  accum = _loss_and_grads(config, (1, 1, 1), batch, grad_accum_steps=4)
  np.testing.assert_allclose(accum[0], full[0], rtol=1e-5)
  for g, ref in zip(jax.tree.leaves(accum[2]), jax.tree.leaves(full[2])):
    np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-4)


def test_train_steps_match_across_meshes():
  """Three optimizer steps on (2,2,2) follow the single-device run."""
  config = small_config()
  batches = [packed_batch(8, 32, 128, seed=s) for s in range(3)]
  runs = {}
  for shape in [(1, 1, 1), (2, 2, 2)]:
    mesh = mesh_of(shape)
    setup = train_setup.build(config, mesh)
    state = train_setup.init_state(setup, seed=0)
    losses = []
    with jax.set_mesh(mesh):
      for b in batches:
        state, m = setup.train_step(state, trainer.to_global_batch(b, mesh))
        losses.append(float(m["loss"]))
    runs[shape] = losses
  np.testing.assert_allclose(runs[(2, 2, 2)], runs[(1, 1, 1)], rtol=1e-5)
  assert runs[(1, 1, 1)][2] < runs[(1, 1, 1)][0]


def test_non_finite_step_is_skipped():
  """A step with a NaN loss leaves params and optimizer state untouched and counts the streak."""
  config = small_config()
  mesh = mesh_of((1, 1, 1))
  setup = train_setup.build(config, mesh)
  state = train_setup.init_state(setup, seed=0)
  batch = packed_batch(8, 32, 128)
  with jax.set_mesh(mesh):
    state, _ = setup.train_step(state, trainer.to_global_batch(batch, mesh))
    before = jax.device_get((state.params, state.opt_state))
    poisoned = state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))
    after, metrics = setup.train_step(poisoned, trainer.to_global_batch(batch, mesh))
  assert float(metrics["skipped"]) == 1.0 and int(metrics["bad_streak"]) == 1
  assert int(after.step) == 2
  # The optimizer state is the pre-step one (the update was not applied).
  for a, b in zip(jax.tree.leaves(jax.device_get(after.opt_state)), jax.tree.leaves(before[1])):
    np.testing.assert_array_equal(a, b)
