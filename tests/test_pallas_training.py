"""The trainer with attention.impl=pallas (interpreted kernels on CPU) follows the xla path."""

import numpy as np
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.validation.checks import validate
from tests.helpers import small_config, train_curves


def _curves(impl, shape, steps=3):
  """Losses and grad norms of `steps` steps on packed rows of 3 documents (train_curves)."""
  config = small_config()
  config.attention.impl = impl
  config.attention.interpret = impl == "pallas"
  config.attention.block_q = config.attention.block_k = 16
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = shape
  validate(config, int(np.prod(shape)), "cpu")
  return train_curves(config, shape, steps, docs_per_row=3)


@pytest.mark.slow
def test_pallas_steps_match_xla_on_a_sharded_mesh():
  """(2,2,2): the kernels run per shard under shard_map (batch over data+fsdp, heads over
  tensor); packed rows exercise segment ids and GQA (H=8, K=4)."""
  xla = _curves("xla", (2, 2, 2))
  pallas = _curves("pallas", (2, 2, 2))
  np.testing.assert_allclose(pallas["loss"], xla["loss"], rtol=2e-5)
  np.testing.assert_allclose(pallas["grad_norm"], xla["grad_norm"], rtol=1e-5)
  # (No "the steps trained" here: each step's batch is another random one, so a last loss below
  # the first holds at learning_rate=0 as well. That small_config's train steps fit their
  # batches is test_parallel.py's test_train_steps_match_across_meshes; this is the kernels'.)


def test_pallas_on_cpu_needs_interpret():
  config = small_config()
  config.attention.impl = "pallas"
  with pytest.raises(ConfigError, match="attention.interpret=True"):
    validate(config, 1, "cpu")
  validate(config, 1, "gpu")  # compiled kernels on accelerators
