"""LoRA and QLoRA in the trainer: only adapters train and are checkpointed, the frozen base is
untouched and rebuilt on resume, the merged export is the trained model, DPO under LoRA uses
the base with adapters off as its reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.checkpointing import checkpointer as ckpt_lib
from jaxtrain.interop import run_weights
from jaxtrain.models.sharding import abstract_model
from jaxtrain.objectives.forward import merge_model
from jaxtrain.peft import state as peft_state
from jaxtrain.train import setup as train_setup, loop as trainer
from tests.helpers import (assert_curves_close, dpo_pair_batch, lora_config, mesh_of,
                           packed_batch)


def _leaf_types(state):
  return {type(v).__name__ for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, nnx.Variable))}


def _train(setup, state, steps, seed=0):
  """(state after `steps` steps on one packed batch, {"loss": [...], "grad_norm": [...]})."""
  config_batch = packed_batch(8, 32, 128, seed=seed)
  curves = {"loss": [], "grad_norm": []}
  with jax.set_mesh(setup.mesh):
    for _ in range(steps):
      state, m = setup.train_step(state, trainer.to_global_batch(config_batch, setup.mesh))
      for key, values in curves.items():
        values.append(float(m[key]))
  return state, curves


@pytest.mark.slow
@pytest.mark.parametrize("quantize_base", ["none", "nf4"])
def test_only_adapters_train_and_the_base_stays_frozen(quantize_base):
  config = lora_config(quantize_base)
  setup = train_setup.build(config, mesh_of((2, 2, 2)))
  state = train_setup.init_state(setup, seed=0)
  assert _leaf_types(state.params) == {"Adapter"}
  adapter_count = sum(x.size for x in jax.tree.leaves(state.params))
  assert adapter_count == peft_state.parameter_counts(setup.model_cfg).trainable
  # Adam's two moments are the adapters' shapes: nothing of the base is in the optimizer.
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  assert moments == 2 * adapter_count
  frozen_before = jax.device_get(state.frozen)
  state, curves = _train(setup, state, 8)
  losses = curves["loss"]
  assert losses[-1] < losses[0] - 0.1, losses
  for before, after in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(state.frozen)):
    np.testing.assert_array_equal(before, jax.device_get(after))
  # The checkpointed state carries no frozen weight.
  assert trainer.checkpointed(state).frozen is None
  # On (2,2,2) the adapters train as on one device: the same losses and gradient norms.
  one = train_setup.build(config, mesh_of((1, 1, 1)))
  _, want = _train(one, train_setup.init_state(one, seed=0), 8)
  assert_curves_close(curves, want, rtol=1e-5)


@pytest.mark.slow
def test_merged_export_computes_what_the_lora_model_computes(tmp_path):
  config = lora_config("int8")
  mesh = mesh_of((1, 1, 1))
  setup = train_setup.build(config, mesh)
  state, _ = _train(setup, train_setup.init_state(setup, seed=0), 4)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), every_steps=1, async_save=False)
  ckpt.manager.save(4, args=ckpt_lib.ocp.args.Composite(
      state=ckpt_lib.ocp.args.StandardSave(trainer.checkpointed(state))), force=True)
  ckpt.close()
  plain, _ = run_weights.load_plain_model(str(tmp_path), config, mesh)
  assert _leaf_types(nnx.state(plain)) == {"Param"}
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
  with jax.set_mesh(mesh):
    want = merge_model(setup.graphdef, state.params, state.frozen)(tokens)
    got = plain(tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
  # The plain weights are what a full fine-tuning checkpoint would hold.
  _, abstract, _ = abstract_model(peft_state.plain_config(setup.model_cfg), mesh)
  assert (jax.tree.structure(nnx.state(plain, nnx.Param))
          == jax.tree.structure(jax.tree.map(lambda x: 0, abstract)))


def test_dpo_under_lora_starts_at_log2_with_the_base_as_reference():
  config = lora_config(objective="dpo")
  config.train.seq_len = 32
  setup = train_setup.build(config, mesh_of((1, 2, 1)))
  state = train_setup.init_state(setup, seed=0)
  assert state.frozen.reference is None  # no second copy: the reference is the base
  batch = dpo_pair_batch()
  losses = []
  with jax.set_mesh(setup.mesh):
    for _ in range(6):
      state, m = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
      losses.append(float(m["loss"]))
  # Fresh adapters (B = 0) leave the policy equal to the reference: every margin is 0.
  assert losses[0] == pytest.approx(np.log(2), abs=1e-6)
  assert losses[-1] < losses[0] and float(m["reward_accuracy"]) > 0.5
