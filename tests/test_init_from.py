"""checkpoint.init_from: params only from converted weights or another run, fresh optimizer."""

import jax
import numpy as np
import pytest

from jaxtrain.checkpointing.weights import save_params
from jaxtrain.config import ConfigError
from jaxtrain.train import setup as train_setup, loop as trainer
from jaxtrain.validation.checks import validate
from tests.helpers import mesh_of, small_config


def _setup(config, shape):
  return train_setup.build(config, mesh_of(shape))


def test_weights_land_on_another_mesh_with_a_fresh_optimizer(tmp_path):
  config = small_config()
  source = train_setup.init_state(_setup(config, (1, 1, 1)), seed=1)
  save_params(tmp_path, source.params)
  config.checkpoint.init_from = str(tmp_path)
  config.mesh.data = config.mesh.fsdp = config.mesh.tensor = 2
  validate(config, 8, "cpu")
  setup = _setup(config, (2, 2, 2))
  state, step = trainer._restore_or_init(setup, None, None, seed=0,  # pylint: disable=protected-access
                                         init_from=str(tmp_path))
  assert step == 0 and int(state.step) == 0
  for got, want, sharding in zip(jax.tree.leaves(state.params), jax.tree.leaves(source.params),
                                 jax.tree.leaves(setup.shardings.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == sharding
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert moments and all(not np.asarray(x).any() for x in moments)  # Adam moments start at 0


def test_weights_of_another_model_are_refused_naming_the_parameters(tmp_path):
  source = train_setup.init_state(_setup(small_config(), (1, 1, 1)), seed=0)
  save_params(tmp_path, source.params)
  setup = _setup(small_config(mlp_dim=256), (1, 1, 1))
  with pytest.raises(ConfigError, match=r"do not match this model config: .*mlp.*\(.*128.*\) vs "
                                        r"model \(.*256.*\)"):
    trainer._restore_or_init(setup, None, None, seed=0,  # pylint: disable=protected-access
                             init_from=str(tmp_path))


def test_init_from_paths_are_checked_before_anything_compiles(tmp_path):
  config = small_config()
  config.checkpoint.init_from = str(tmp_path / "missing")
  with pytest.raises(ConfigError, match="checkpoint.init_from=.*no such directory"):
    validate(config, 1, "cpu")
  setup = _setup(small_config(), (1, 1, 1))
  with pytest.raises(ConfigError, match="holds neither params/"):
    trainer._restore_or_init(setup, None, None, seed=0,  # pylint: disable=protected-access
                             init_from=str(tmp_path))
