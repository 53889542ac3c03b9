"""The device mesh and the one table mapping logical axis names to mesh axes.

Parallelism is data here, not code: params and activations name their dims logically (`embed`,
`heads`, ...) and LOGICAL_RULES says which mesh axes shard each. FSDP, tensor, context and data
parallelism are rows of this table; a new parallelism adds a mesh axis and rows.

Axis order is device order: later axes are laid over the closest devices, so `tensor` (a
collective per matmul), `context` (K/V exchanges per layer) and `expert` (two all-to-alls per
MoE layer) get the fastest links.

The `expert` axis splits a Mixture-of-Experts layer's experts (parallel/expert_parallel.py moves
the tokens to them and back); everywhere else it is one more data-parallel axis: it splits the
batch, and the weights outside the experts are sharded over it as over fsdp.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "stage", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")
# The axes that may span host groups over the data-center network (mesh.dcn_*): the batch axes,
# whose collectives are one gradient reduction a step, and pipeline stages, which pass one
# microbatch's activations between neighbours.
DCN_AXES = ("data", "stage", "fsdp")

# logical name -> mesh axis (or tuple of axes, or None = replicated). Every logical name used by
# the model must appear: flax treats an unknown name as a mesh-axis name and fails.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    # Weights are sharded over `context` and `expert` as over fsdp: a context- or
    # expert-parallel run holds no more weight bytes per device than an fsdp run on as many
    # devices.
    ("embed", ("fsdp", "context", "expert")),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    # Pipeline stages: each holds a contiguous group of the stacked layers (jaxtrain.parallel.pipeline).
    ("layers", "stage"),
    ("lora_rank", None),
    # Latent attention's ranks (models/mla.py): whole where a projection makes them (its D
    # input is sharded like `embed`), split over fsdp and context where one takes them in (the
    # query rank of q_b, the key/value rank of kv_b), so FSDP splits those weights too; not
    # over `expert` as well: the ranks (1536, 512) are smaller than D and would not divide.
    ("latent", None),
    # Multi-token prediction's projection [2D, D] (models/mtp.py): its input is two D halves.
    ("mtp_in", None),
    ("q_latent", ("fsdp", "context")),
    ("kv_latent", ("fsdp", "context")),
    # MoE experts [X, D, F]: the experts split over `expert`; inside an expert, D is stored
    # sharded like `embed` (less the expert axis, which the expert dim holds) and F like `mlp`.
    ("experts", "expert"),
    ("expert_embed", ("fsdp", "context")),
    ("expert_mlp", "tensor"),  # LoRA adapters: the rank dim is small; shard only their I/O dims
    # activations: the batch is split over every data-parallel axis and the sequence over
    # `context`; the model dim is whole on each device between layers (fsdp gathers weights,
    # not activations).
    ("act_batch", BATCH_AXES),
    ("act_length", "context"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)
_RULES = dict(LOGICAL_RULES)


class MeshShape:
  """A size for every axis of MESH_AXES, looked up by name: `shape["fsdp"]` or `shape.fsdp`."""

  __slots__ = ("_sizes",)

  def __init__(self, sizes: Mapping[str, int] | None = None, **named: int):
    given = {**(sizes or {}), **named}
    unknown = sorted(set(given) - set(MESH_AXES))
    if unknown:
      raise ValueError(f"unknown mesh axes {unknown}; the axes are {MESH_AXES}")
    object.__setattr__(self, "_sizes", tuple(int(given.get(a, 1)) for a in MESH_AXES))

  def __getitem__(self, axis: str) -> int:
    return self._sizes[MESH_AXES.index(axis)]

  def __getattr__(self, axis: str) -> int:
    if axis in MESH_AXES:
      return self[axis]
    raise AttributeError(axis)

  def __setattr__(self, name, value):
    raise AttributeError("MeshShape is immutable")

  def __eq__(self, other) -> bool:
    return isinstance(other, MeshShape) and self._sizes == other._sizes

  def __hash__(self) -> int:
    return hash(self._sizes)

  def __repr__(self) -> str:
    return f"MeshShape({', '.join(f'{a}={s}' for a, s in self.items())})"

  def items(self) -> tuple[tuple[str, int], ...]:
    return tuple(zip(MESH_AXES, self._sizes))

  def describe(self) -> str:
    """"data=1 stage=1 fsdp=8 expert=1 context=1 tensor=1": for run tables and messages."""
    return " ".join(f"{a}={s}" for a, s in self.items())

  def batch_keys(self) -> tuple[str, str]:
    """("mesh.data*mesh.fsdp", "2*4"): the axes splitting the batch and their sizes, for
    messages (mesh.expert only where it is > 1)."""
    axes = [a for a in BATCH_AXES if a != "expert" or self.expert > 1]
    return "*".join(f"mesh.{a}" for a in axes), "*".join(str(self[a]) for a in axes)

  @property
  def batch_shards(self) -> int:
    """How many ways the batch is split: the product of BATCH_AXES."""
    return math.prod(self[a] for a in BATCH_AXES)


def resolve_shape(requested: Mapping[str, int], num_devices: int) -> MeshShape:
  """Fills the one axis of size -1 so the sizes multiply to `num_devices`.

  `requested` names a size for each axis (missing: 1). Raises ValueError with one line naming
  the `mesh.<axis>` keys and the fix.
  """
  sizes = {axis: int(requested.get(axis, 1)) for axis in MESH_AXES}
  for axis, size in sizes.items():
    if size == 0 or size < -1:
      raise ValueError(f"mesh.{axis}={size}: mesh axis sizes must be positive (or -1 for one "
                       f"axis to take the remaining devices)")
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"mesh.{free[1]}=-1: only one mesh axis may be -1 (also mesh.{free[0]}=-1); "
                     f"give the others explicit sizes")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % fixed:
      given = " ".join(f"mesh.{a}={s}" for a, s in sizes.items())
      raise ValueError(f"{given}: the fixed axes multiply to {fixed}, which does not divide the "
                       f"{num_devices} devices, so mesh.{free[0]}=-1 cannot fill them; choose "
                       f"sizes whose product divides {num_devices}")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    product = "*".join(f"mesh.{a}" for a in MESH_AXES)
    values = "*".join(str(s) for s in sizes.values())
    raise ValueError(f"{product}={values}={fixed}, but {num_devices} devices are present; make "
                     f"the product {num_devices} or set one axis to -1")
  return MeshShape(sizes)


# The model dim each sharded parameter axis labels (its config key). Every mesh axis that
# LOGICAL_RULES lets shard one of them must divide it: the divisibility rules, derived from the
# one table rather than written per axis.
PARAM_DIMS = {"vocab": "model.vocab_size", "embed": "model.d_model", "mlp": "model.mlp_dim",
              "heads": "model.num_heads", "kv_heads": "model.num_kv_heads",
              "experts": "moe.num_experts", "expert_mlp": "moe.expert_mlp_dim",
              "q_latent": "model.q_lora_rank", "kv_latent": "model.kv_lora_rank"}


def check_divides(shape: MeshShape, dims: Mapping[str, int]) -> None:
  """Raises ValueError (one line: key, value, fix) when the mesh axes sharding a model dim do
  not divide it; `dims` maps PARAM_DIMS' config keys to their values (a key missing or 0: a
  dim the model does not have, e.g. the experts of a dense model)."""
  for logical, key in PARAM_DIMS.items():
    axes = _RULES[logical]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size, value = math.prod(shape[a] for a in axes), int(dims.get(key, 0))
    if axes and value and value % size:
      split = [a for a in axes if shape[a] > 1]  # name only the axes that split the dim
      keys = "*".join(f"mesh.{a}" for a in split)
      sizes = "*".join(str(shape[a]) for a in split)
      hint = max(d for d in range(1, size + 1) if value % d == 0)
      named = keys if len(split) == 1 else f"{keys}={sizes}"
      raise ValueError(f"{named}={size}: does not divide {key}={value}; use sizes whose "
                       f"product divides it (e.g. {hint})")


def param_dims(config) -> dict[str, int]:
  """PARAM_DIMS' values in a run config (the keys its groups have)."""
  out = {}
  for key in PARAM_DIMS.values():
    group, field = key.split(".")
    if group in config and field in config[group]:
      out[key] = int(config[group][field])
  return out


def make_mesh(shape: Mapping[str, int] | MeshShape | None = None,
              devices: Sequence[jax.Device] | None = None, *,
              dcn: Mapping[str, int] | None = None) -> Mesh:
  """The mesh over `devices` (default: all) with the axis sizes of `shape` (axes not named: 1;
  one may be -1: the rest of the devices; default: fsdp over all of them).

  With `dcn` sizes > 1 (DCN_AXES only) the mesh is hybrid: the devices form prod(dcn) groups
  (TPU slices, or processes where devices have no slices, as on GPU hosts and CPU), each laid
  out as shape/dcn over its fast interconnect (ICI, NVLink), and the groups are tiled along
  those axes, so only they cross the slower data-center network. Tensor and context
  parallelism never leave a group.

  Axes are Auto (GSPMD propagation): the model states shardings for params and a few activation
  constraints, and XLA chooses the collectives.
  """
  devices = list(jax.devices() if devices is None else devices)
  if shape is None:
    shape = {"fsdp": -1}
  if not isinstance(shape, MeshShape):
    shape = resolve_shape(shape, len(devices))
  if math.prod(s for _, s in shape.items()) != len(devices):
    raise ValueError(f"mesh {shape.describe()} has {math.prod(s for _, s in shape.items())} "
                     f"devices, but {len(devices)} are present")
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if math.prod(int(s) for s in (dcn or {}).values()) == 1:
    sizes = tuple(s for _, s in shape.items())
    return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
  return Mesh(hybrid_device_grid(shape, devices, dcn), MESH_AXES, axis_types=axis_types)


def hybrid_device_grid(shape: MeshShape, devices: Sequence, dcn: Mapping[str, int]) -> np.ndarray:
  """The devices as an array of shape `shape` (MESH_AXES order) in which each axis in `dcn` is
  split into that many host groups (slices, else processes) and every other axis stays within
  one group: the layout of `make_mesh(shape, devices, dcn=dcn)`."""
  unknown = sorted(set(dcn) - set(DCN_AXES))
  if unknown:
    raise ValueError(f"only {DCN_AXES} may span host groups, got dcn axes {unknown}")
  sizes = tuple(s for _, s in shape.items())
  dcn_sizes = tuple(int(dcn.get(a, 1)) for a in MESH_AXES)
  if any(s % d for s, d in zip(sizes, dcn_sizes)):
    raise ValueError(f"mesh {shape.describe()} is not divisible by the host groups "
                     f"{dict(zip(MESH_AXES, dcn_sizes))}")
  ici = tuple(s // d for s, d in zip(sizes, dcn_sizes))
  return mesh_utils.create_hybrid_device_mesh(
      ici, dcn_sizes, devices, process_is_granule=num_slices(devices) == 1)


def platform_of_backend(name: str) -> str:
  """"cpu", "gpu" or "tpu" from a JAX backend or device platform name ("cuda", "rocm", ...)."""
  return "gpu" if name in ("gpu", "cuda", "rocm") else name


def mesh_platform(mesh: Mesh) -> str:
  """What a program over `mesh` compiles for: its devices' platform ("cpu", "gpu", "tpu").

  Deviceless targets (jax.experimental.topologies) give TPU or GPU devices in a CPU process,
  so code that picks a kernel asks the mesh, never `jax.default_backend()`.
  """
  return platform_of_backend(mesh.devices.flat[0].platform)


def axis_size(axis: str, mesh=None) -> int:
  """The size of mesh axis `axis` in `mesh` (default: the current abstract mesh, as code traced
  under `jax.set_mesh` sees it); 1 outside a mesh or where the mesh lacks the axis."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty or axis not in mesh.axis_names:
    return 1
  return int(mesh.shape[axis])


def num_slices(devices: Sequence[jax.Device] | None = None) -> int:
  """TPU slices the devices span (multislice); 1 where devices have no slices (GPU, CPU)."""
  devices = jax.devices() if devices is None else devices
  return len({getattr(d, "slice_index", 0) for d in devices})


def batch_rows_by_process(mesh: Mesh, batch_size: int) -> dict[int, np.ndarray]:
  """The rows of a global [batch_size, ...] batch each process's devices hold under
  `batch_sharding` (sorted): what that process must load. Processes whose devices are replicas
  of each other get the same rows."""
  rows: dict[int, set[int]] = {}
  indices = batch_sharding(mesh, 1).devices_indices_map((batch_size,))
  for device, (index,) in indices.items():
    rows.setdefault(device.process_index, set()).update(range(*index.indices(batch_size)))
  return {p: np.array(sorted(r), dtype=np.int64) for p, r in sorted(rows.items())}


def logical_to_spec(names: Sequence[str | None]) -> P:
  """PartitionSpec for a tuple of logical axis names, via LOGICAL_RULES."""
  return P(*(None if n is None else _RULES[n] for n in names))


# The axes that shard weights for storage only (FSDP, and context and expert alongside it): a
# matmul needs the weight whole along them, so GSPMD gathers it there before each use. (The
# `experts` dim of the MoE weights is split over `expert` for compute: it stays split.)
WEIGHT_STORAGE_AXES = ("fsdp", "context", "expert")


def gathered_spec(names: Sequence[str | None]) -> P:
  """PartitionSpec of a weight gathered whole along WEIGHT_STORAGE_AXES (what FSDP gathers before
  a matmul); its other axes (tensor, stage) stay."""
  def keep(axes):
    axes = axes if isinstance(axes, tuple) else (axes,)
    kept = tuple(a for a in axes if a is not None and a not in WEIGHT_STORAGE_AXES)
    return kept[0] if len(kept) == 1 else (kept or None)
  return P(*(None if n is None else _RULES[n] if n == "experts" else keep(_RULES[n])
             for n in names))


def shard(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical names; a no-op outside a mesh context.

  Model code calls this at the few places where propagation alone picks badly (the residual
  stream, attention heads, logits), so the model runs unchanged on one device or a pod.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Sharding of a host batch [B, T, ...]: B over the data-parallel axes, the rest whole."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
