"""Full-size configs, abstractly (no memory): parameter counts and FSDP shardings."""

import os

import jax
import numpy as np
import pytest

from jaxtrain.config import load_config_file
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from jaxtrain.train import metrics
from tests.helpers import mesh_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = {"llama8b": 8.03e9, "llama70b": 70.55e9, "llama405b": 405.85e9,
            "llama3_1b": 1.236e9, "llama3_3b": 3.213e9}


def _abstract(name, mesh_shape):
  config = load_config_file(os.path.join(REPO, "configs", f"{name}.py"))
  config.attention.impl = "xla"
  cfg = ModelConfig.from_config(config)
  return cfg, abstract_model(cfg, mesh_of(mesh_shape))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parameter_count(name):
  cfg, (_, abstract_params, _) = _abstract(name, (1, 8, 1))
  count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract_params))
  assert abs(count - EXPECTED[name]) / EXPECTED[name] < 1e-3, count
  assert count == metrics.count_params(cfg.arch)


def test_8b_fsdp_leaves_no_large_param_replicated():
  _, (_, abstract_params, shardings) = _abstract("llama8b", (1, 8, 1))
  limit = 64 * 2**20
  for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(abstract_params),
                          jax.tree.leaves(shardings)):
    nbytes = int(np.prod(a.shape)) * a.dtype.itemsize
    per_device = int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
    if nbytes > limit:
      assert per_device * 8 == nbytes, (jax.tree_util.keystr(path), s.spec)


def test_70b_shards_over_fsdp_and_tensor():
  _, (_, abstract_params, shardings) = _abstract("llama70b", (1, 4, 2))
  total = sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
              for a, s in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(shardings)))
  full = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(abstract_params))
  assert total < full / 7.9  # everything but the (tiny) norm scales is split 8 ways
