"""Abstract model → shardings → sharded init: weights are never whole on one device.

The model is built under `nnx.eval_shape` (no memory), its logical axis names are resolved to
NamedShardings through mesh.LOGICAL_RULES, and the real init runs inside `jax.jit` with those
out_shardings, so each device only ever allocates its own shard.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.mesh import LOGICAL_RULES
from jaxtrain.model import Llama, ModelConfig


def abstract_model(cfg: ModelConfig, mesh: Mesh):
  """(graphdef, abstract params with .sharding, param shardings) with no allocation."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_RULES):
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(model)
    shardings = nnx.get_named_sharding(abstract_params, mesh)
  abstract_params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params, shardings)
  return graphdef, abstract_params, shardings


def init_params_fn(cfg: ModelConfig):
  """key -> params; to be traced inside jit under the mesh, with out_shardings from
  `abstract_model`, so every parameter is created directly in its shards."""
  def init(key):
    with nnx.logical_axis_rules(LOGICAL_RULES):
      return nnx.state(Llama(cfg, rngs=nnx.Rngs(params=key)))
  return init


def init_params(cfg: ModelConfig, mesh: Mesh, seed: int):
  """(graphdef, params) with every parameter created directly in its shards."""
  graphdef, _, shardings = abstract_model(cfg, mesh)
  init = init_params_fn(cfg)
  with jax.set_mesh(mesh):
    params = jax.jit(init, out_shardings=shardings)(jax.random.key(seed))
  return graphdef, params


def create_model(cfg: ModelConfig, mesh: Mesh, seed: int = 0) -> Llama:
  """A sharded, ready-to-call model (tests, generation, interop)."""
  graphdef, params = init_params(cfg, mesh, seed)
  return nnx.merge(graphdef, params)
