"""Same loss and gradients on every mesh; gradient accumulation equals the full batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model, init_params
from jaxtrain.train import setup as train_setup, loop as trainer
from jaxtrain.train.step import make_grad_fn
from tests.helpers import assert_curves_close, mesh_of, packed_batch, small_config

# (mesh, attention.context_parallel). The stage mesh: pipeline stages (2 microbatches, the
# default for 2 stages) against the plain scan. The context meshes: the sequence split in the
# load-balanced layout, every gradient through ring attention's own backward pass or the
# all-gather's (pipeline stages and context do not combine: config_checks refuses them).
MESHES = [((1, 1, 1), "all_gather"), ((8, 1, 1), "all_gather"), ((1, 8, 1), "all_gather"),
          ((2, 2, 2), "all_gather"), ((1, 2, 4), "all_gather"),
          ({"stage": 2, "fsdp": 2, "tensor": 2}, "all_gather"),
          ({"context": 2, "fsdp": 2, "tensor": 2}, "ring"),
          ({"context": 4, "data": 2}, "all_gather")]


def _config(strategy="all_gather"):
  config = small_config()
  config.attention.context_parallel = strategy
  return config


@functools.lru_cache(maxsize=None)
def _jitted_grad_fn(shape_items, strategy, grad_accum_steps):
  """(mesh, params, jitted grad_fn) of the small config on a mesh, built once per process: the
  module's tests share the one-device full-batch and accumulated programs."""
  mesh_shape = dict(shape_items) if isinstance(shape_items[0], tuple) else shape_items
  config = _config(strategy)
  mesh = mesh_of(mesh_shape)
  cfg = ModelConfig.from_config(config)
  graphdef, params = init_params(cfg, mesh, seed=0)
  _, _, shardings = abstract_model(cfg, mesh)
  grad_fn = jax.jit(make_grad_fn(graphdef, grad_accum_steps=grad_accum_steps,
                                 loss_chunk_size=config.train.loss_chunk_size,
                                 param_shardings=shardings))
  return mesh, params, grad_fn


def _loss_and_grads(mesh_shape, batch, grad_accum_steps=1, strategy="all_gather"):
  key = tuple(mesh_shape.items()) if isinstance(mesh_shape, dict) else tuple(mesh_shape)
  mesh, params, grad_fn = _jitted_grad_fn(key, strategy, grad_accum_steps)
  with jax.set_mesh(mesh):
    loss, count, grads = grad_fn(params, trainer.to_global_batch(batch, mesh))
  return float(loss), float(count), jax.device_get(nnx.to_pure_dict(grads)), grads


@pytest.fixture(scope="module")
def reference():
  batch = packed_batch(8, 32, 128)
  return batch, _loss_and_grads((1, 1, 1), batch)


def _mesh_id(mesh):
  shape, strategy = mesh
  if isinstance(shape, dict):
    return "-".join(f"{k}{v}" for k, v in shape.items()) + (
        f"-{strategy}" if "context" in shape else "")
  return "x".join(map(str, shape))


@pytest.mark.parametrize("mesh", MESHES[1:], ids=_mesh_id)
def test_same_loss_and_grads_on_every_mesh(reference, mesh):
  mesh_shape, strategy = mesh
  batch, (ref_loss, ref_count, ref_grads, _) = reference
  loss, count, grads, sharded = _loss_and_grads(mesh_shape, batch, strategy=strategy)
  assert count == ref_count
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
  for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
  # The gradients really are sharded as their params (not silently replicated).
  _, _, shardings = abstract_model(ModelConfig.from_config(_config(strategy)),
                                   mesh_of(mesh_shape))
  for g, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(shardings)):
    assert g.sharding.is_equivalent_to(s, g.ndim)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 2, 2)])
def test_grad_accumulation_equals_full_batch(reference, mesh_shape):
  batch, (ref_loss, ref_count, ref_grads, _) = reference
  loss, count, grads, _ = _loss_and_grads(mesh_shape, batch, grad_accum_steps=4)
  assert count == ref_count
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-4)


def test_accumulation_weights_microbatches_by_tokens():
  """Microbatches with different token counts: the mean is over tokens, not over microbatches."""
  batch = packed_batch(8, 32, 128, seed=3)
  batch["loss_mask"][::4, 8:] = 0.0  # rows 0 and 4: microbatch 0 of 4 has far fewer tokens
  full = _loss_and_grads((1, 1, 1), batch)
  accum = _loss_and_grads((1, 1, 1), batch, grad_accum_steps=4)
  np.testing.assert_allclose(accum[0], full[0], rtol=1e-5)
  for g, ref in zip(jax.tree.leaves(accum[2]), jax.tree.leaves(full[2])):
    np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-4)


def _train(config, shape, steps: int):
  """helpers.train_curves' run (the same batches: seed = step, 2 documents a row), also
  returning the final params and the batches."""
  setup = train_setup.build(config, mesh_of(shape))
  state = train_setup.init_state(setup, seed=0)
  curves, batches = {"loss": [], "grad_norm": []}, []
  with jax.set_mesh(setup.mesh):
    for step in range(steps):
      batches.append(packed_batch(config.train.global_batch_size, config.train.seq_len,
                                  config.model.vocab_size, seed=step, docs_per_row=2))
      state, metrics = setup.train_step(state, trainer.to_global_batch(batches[-1], setup.mesh))
      for key, values in curves.items():
        values.append(float(metrics[key]))
  return curves, state.params, batches


def test_train_steps_match_across_meshes():
  """Three optimizer steps on (2,2,2) follow the single-device run: losses and grad norms; and
  the steps trained, so the later steps compare updated params."""
  config = small_config()
  runs = {shape: _train(config, shape, steps=3) for shape in [(1, 1, 1), (2, 2, 2)]}
  assert_curves_close(runs[(2, 2, 2)][0], runs[(1, 1, 1)][0], rtol=1e-5)
  # Trained: the batches the steps trained on lose less at the final params than at the
  # initial ones (this module's one-device grad function; the same init). Not "the last step's
  # loss is below the first's": each step's batch is another random one, so that holds at
  # learning_rate=0 too, and on random tokens two updates do not lower the next batch's loss.
  mesh, params, grad_fn = _jitted_grad_fn((1, 1, 1), "all_gather", 1)
  _, trained_params, batches = runs[(1, 1, 1)]
  with jax.set_mesh(mesh):
    before, after = (np.mean([float(grad_fn(p, trainer.to_global_batch(b, mesh))[0])
                              for b in batches]) for p in (params, trained_params))
  assert after < before - 0.01, (after, before)  # 4.823 < 4.859; equal at learning_rate=0


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
