"""The LoRA/QLoRA model's state for the trainer: which variables train, the frozen base built
from a plain model's params, merged weights for export, and sizes.

Split a LoRA model as
    graphdef, adapters, frozen = nnx.split(model, trainable_filter(cfg), ...)
and rebuild it with nnx.merge(graphdef, adapters, frozen). `adapters` holds only `Adapter`
variables (optimizer state and checkpoints); `frozen` holds the base: nnx.Param for embedding,
norms, head and unquantized projections, `Quantized` codes/scales for quantized ones. With
lora_rank=0 the same call gives (graphdef, every Param, empty): full fine-tuning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh

# The decoder imports jaxtrain.peft (for project/adapters), so only the module object is bound
# here; its attributes are looked up at call time, after both modules have loaded.
from jaxtrain.models import decoder as decoder_lib
from jaxtrain.models.variables import HEAD_NAMES, WEIGHTS, Head, RouterBias
from jaxtrain.ops.quantize import QuantizedWeight
from jaxtrain.parallel.mesh import LOGICAL_RULES, MESH_AXES
from jaxtrain.peft.lora import Adapter, ExpertLoRA, LoRA


_ONE_DEVICE = AbstractMesh((1,) * len(MESH_AXES), MESH_AXES,
                           axis_types=(AxisType.Auto,) * len(MESH_AXES))


def plain_config(cfg):
  """`cfg` without adapters or quantization: the model whose params a base checkpoint holds."""
  return dataclasses.replace(cfg, peft=type(cfg.peft)())


def trainable_filter(cfg):
  """nnx filter of the variables that train: under LoRA the adapters and the objective's heads
  (a reward model's score head, PPO's value head), else every Param."""
  return nnx.Any(Adapter, Head) if cfg.peft.lora_rank > 0 else nnx.Param


def heads_from_base(trainable, base_params):
  """The trainable state of a LoRA model with its heads (score_D1, value_D1) taken from the
  plain model's params `base_params`, cast to the heads' dtype: a base checkpoint's own head (a
  reward model's), else the zeros `checkpoint.load_params` starts a new head at, or the seed's
  random init of the base. Pure: jit it."""
  flat = dict(nnx.to_flat_state(trainable))
  for path, head in flat.items():
    if len(path) == 1 and path[0] in HEAD_NAMES:
      value = jnp.asarray(_value(base_params[path[0]]))
      flat[path] = head.replace(value.astype(_value(head).dtype))
  return nnx.from_flat_state(flat)



def _abstract(cfg):
  """Model `cfg` as shapes (no memory). Variables apply their logical sharding when created,
  which takes the rules and a mesh: the caller's, else an abstract one-device mesh (which,
  unlike jax.set_mesh, may be entered inside jit)."""
  with contextlib.ExitStack() as stack:
    stack.enter_context(nnx.logical_axis_rules(LOGICAL_RULES))
    if jax.sharding.get_abstract_mesh().empty:
      stack.enter_context(jax.sharding.use_abstract_mesh(_ONE_DEVICE))
    return nnx.eval_shape(lambda: decoder_lib.Decoder(cfg, rngs=nnx.Rngs(0)))


def _key(path) -> tuple[str, ...]:
  """A state path with every key as a string (unrolled layers index by int or by str)."""
  return tuple(str(k) for k in path)


def _value(leaf):
  return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def frozen_from_base(base_params, cfg):
  """The frozen state of the LoRA/QLoRA model `cfg` from the param state of its plain model.

  `base_params`: nnx.State (or nested dict) of the plain model's params, laid out as
  `plain_config(cfg)` lays them (scanned or unrolled layers), any float dtype. Projections are
  quantized when cfg.peft.base_quant != "none" (stacked weights one layer at a time); everything is
  cast to the param dtype. Pure: jit it with out_shardings of the abstract LoRA model's frozen
  part. Empty when lora_rank == 0 (then every param trains).
  """
  model = _abstract(cfg)
  base = {_key(path): _value(leaf)
          for path, leaf in nnx.to_flat_state(nnx.State(base_params) if isinstance(
              base_params, dict) else base_params)}
  expected = {_key(path): var for path, var in nnx.to_flat_state(
      nnx.state(_abstract(plain_config(cfg)), WEIGHTS))}
  missing = sorted("/".join(p) for p in expected.keys() - base.keys())
  extra = sorted("/".join(p) for p in base.keys() - expected.keys())
  if missing or extra:
    raise ValueError(f"frozen_from_base: the base params are not those of the plain model "
                     f"(scan_layers={cfg.runtime.scan_layers}); missing {missing[:4]}, unexpected "
                     f"{extra[:4]}; load the base with the same model.* config")
  for path, var in expected.items():
    if tuple(base[path].shape) != tuple(var.shape):
      raise ValueError(f"frozen_from_base: {'/'.join(path)} has shape {tuple(base[path].shape)}, "
                       f"the model expects {tuple(var.shape)}")
  param_dtype = jnp.dtype(cfg.runtime.param_dtype)
  for path, node in list(nnx.iter_graph(model)):
    if isinstance(node, QuantizedWeight):
      node.quantize_from(base[_key(path)])
    elif isinstance(node, nnx.Param):
      node.set_value(jnp.asarray(base[_key(path)]).astype(param_dtype))
    elif isinstance(node, RouterBias):  # float32 whatever the param dtype
      node.set_value(jnp.asarray(base[_key(path)]).astype(jnp.float32))
  return nnx.state(model, nnx.Not(trainable_filter(cfg)))


def merged_params(model):
  """The plain model's param state (lora_rank=0, base_quant="none": the tree of a plain model,
  in its param dtype) with W + (alpha / r) A @ B folded in and quantized weights dequantized:
  for Hugging Face export, save_params and generation. Jit-able given the model as an argument,
  e.g. jax.jit(lambda g, a, f: merged_params(nnx.merge(g, a, f)), out_shardings=...)."""
  cfg = model.cfg
  plain = _abstract(plain_config(cfg))
  nodes = {_key(path): node for path, node in nnx.iter_graph(model)}
  deltas = {_key(path[:-1]) + (node.weight_name,): node.delta_weight()
            for path, node in nnx.iter_graph(model) if isinstance(node, (LoRA, ExpertLoRA))}
  param_dtype = jnp.dtype(cfg.runtime.param_dtype)
  for path, var in list(nnx.iter_graph(plain)):
    if isinstance(var, RouterBias):
      var.set_value(nodes[_key(path)][...])
      continue
    if not isinstance(var, nnx.Param):
      continue
    source = nodes[_key(path)]
    if isinstance(source, QuantizedWeight):
      w = source.dequantize(jnp.float32)
    else:
      w = source[...]
    if _key(path) in deltas:
      w = w.astype(jnp.float32) + deltas[_key(path)]
    var.set_value(w.astype(param_dtype))
  return nnx.state(plain, WEIGHTS)


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
  total: int  # parameters of the model: the plain model's plus the adapters'
  trainable: int  # adapter params under LoRA, else all
  trainable_bytes: int
  frozen_bytes: int  # stored bytes of the frozen base (codes + scales when quantized)
  quantized: int  # base parameters stored quantized


def _sizes(state):
  leaves = jax.tree.leaves(state)
  return sum(math.prod(x.shape) for x in leaves), sum(
      math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)


def parameter_counts(cfg) -> ParameterCounts:
  """Counts and bytes from the abstract model (no allocation; fine for 8B/70B)."""
  model = _abstract(cfg)
  _, trainable, frozen = nnx.split(model, trainable_filter(cfg), ...)
  trainable_count, trainable_bytes = _sizes(trainable)
  _, frozen_bytes = _sizes(frozen)
  plain_count, _ = _sizes(nnx.state(_abstract(plain_config(cfg)), nnx.Param))
  quantized = sum(node.num_params() for _, node in nnx.iter_graph(model)
                  if isinstance(node, QuantizedWeight))
  adapters = trainable_count if cfg.peft.lora_rank > 0 else 0
  return ParameterCounts(total=plain_count + adapters, trainable=trainable_count,
                         trainable_bytes=trainable_bytes, frozen_bytes=frozen_bytes,
                         quantized=quantized)


def _axis_size(mesh: Mesh, name) -> int:
  axes = dict(LOGICAL_RULES).get(name) if name is not None else None
  axes = (axes,) if isinstance(axes, str) else (axes or ())
  return math.prod(mesh.shape[a] for a in axes)


def check_mesh(cfg, mesh: Mesh):
  """Raises ValueError when a quantized weight's codes or scales cannot be split evenly over
  `mesh` (jit refuses uneven shardings). Scales have I / quant_group_size rows along the input
  dim's axis: e.g. 2 rows for D=128, group 64 cannot split over fsdp=8."""
  model = _abstract(cfg)
  bad, nodes = [], []
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, QuantizedWeight):
      continue
    in_size = node.in_size
    split = _axis_size(mesh, node.storage_names[0])
    nodes.append((in_size, split))
    groups = in_size // cfg.peft.quant_group_size
    if groups % split or (in_size // 2) % split:
      bad.append(f"{'/'.join(map(str, path))} ({groups} groups of {in_size} inputs over "
                 f"{node.storage_names[0]!r}, split {split} ways)")
  if bad:
    fits = [g for g in (256, 128, 64, 32, 16, 8, 4, 2)
            if all(i % g == 0 and (i // g) % s == 0 for i, s in nodes)]
    raise ValueError(f"lora.quant_group_size={cfg.peft.quant_group_size}: quantization scales cannot "
                     f"be sharded evenly on mesh {dict(mesh.shape)}: {'; '.join(bad[:3])}; use "
                     f"lora.quant_group_size={fits[0] if fits else '(none fits)'} or fewer "
                     f"devices on that mesh axis")
  return True
