"""The trainer with attention.impl=pallas (interpreted kernels on CPU) follows the xla path."""

import jax
import numpy as np
import pytest

from jaxtrain import train_setup, trainer
from jaxtrain.config import ConfigError
from jaxtrain.config_checks import validate
from tests.helpers import mesh_of, packed_batch, small_config


def _losses(impl, shape, steps=3):
  config = small_config()
  config.attention.impl = impl
  config.attention.interpret = impl == "pallas"
  config.attention.block_q = config.attention.block_k = 16
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = shape
  validate(config, int(np.prod(shape)), "cpu")
  mesh = mesh_of(shape)
  setup = train_setup.build(config, mesh)
  losses = []
  with jax.set_mesh(mesh):
    state = train_setup.init_state(setup, seed=0)
    for i in range(steps):
      batch = trainer.to_global_batch(packed_batch(8, 32, 128, seed=i, docs_per_row=3), mesh)
      state, metrics = setup.train_step(state, batch)
      losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.slow
def test_pallas_steps_match_xla_on_a_sharded_mesh():
  """(2,2,2): the kernels run per shard under shard_map (batch over data+fsdp, heads over
  tensor); packed rows exercise segment ids and GQA (H=8, K=4)."""
  xla = _losses("xla", (2, 2, 2))
  pallas = _losses("pallas", (2, 2, 2))
  np.testing.assert_allclose(pallas, xla, rtol=2e-5)
  assert xla[-1] < xla[0]  # the steps trained


def test_pallas_on_cpu_needs_interpret():
  config = small_config()
  config.attention.impl = "pallas"
  with pytest.raises(ConfigError, match="attention.interpret=True"):
    validate(config, 1, "cpu")
  validate(config, 1, "gpu")  # compiled kernels on accelerators
