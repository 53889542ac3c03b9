"""Abstract model → shardings → sharded init: weights are never whole on one device.

The model is built under `nnx.eval_shape` (no memory), its logical axis names are resolved to
NamedShardings through mesh.LOGICAL_RULES, and the real init runs inside `jax.jit` with those
out_shardings, so each device only ever allocates its own shard.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.decoder import Decoder
from jaxtrain.parallel.mesh import LOGICAL_RULES
from jaxtrain.peft import state as peft_state


def abstract_model(cfg: ModelConfig, mesh: Mesh, filters: tuple | None = None):
  """(graphdef, abstract params with .sharding, param shardings) with no allocation.

  With `filters` (nnx filters, e.g. LoRA's (adapters, ...)), the params are split by them and the
  second and third items are tuples with one state per filter.
  """
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_RULES):
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, *states = nnx.split(model, *(filters or ()))
    shardings = [nnx.get_named_sharding(state, mesh) for state in states]
  abstract = [jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           state, sharding) for state, sharding in zip(states, shardings)]
  if filters:
    return graphdef, tuple(abstract), tuple(shardings)
  return graphdef, abstract[0], shardings[0]


def init_params_fn(cfg: ModelConfig, trainable_only: bool = False):
  """key -> params; to be traced inside jit under the mesh, with out_shardings from
  `abstract_model`, so every parameter is created directly in its shards. With
  `trainable_only` (LoRA), only the adapters: XLA drops the unused base initialization."""
  def init(key):
    with nnx.logical_axis_rules(LOGICAL_RULES):
      model = Decoder(cfg, rngs=nnx.Rngs(params=key))
      if trainable_only:
        return nnx.state(model, peft_state.trainable_filter(cfg))
      return nnx.state(model)
  return init


def init_params(cfg: ModelConfig, mesh: Mesh, seed: int):
  """(graphdef, params) with every parameter created directly in its shards."""
  graphdef, _, shardings = abstract_model(cfg, mesh)
  init = init_params_fn(cfg)
  with jax.set_mesh(mesh):
    params = jax.jit(init, out_shardings=shardings)(jax.random.key(seed))
  return graphdef, params


def create_model(cfg: ModelConfig, mesh: Mesh, seed: int = 0) -> Decoder:
  """A sharded, ready-to-call model (tests, generation, interop)."""
  graphdef, params = init_params(cfg, mesh, seed)
  return nnx.merge(graphdef, params)
