"""The device mesh and the one table mapping logical axis names to mesh axes.

Parallelism is data here, not code: params and activations name their dims logically (`embed`,
`heads`, ...) and LOGICAL_RULES says which mesh axes shard each. FSDP, tensor and data parallelism
are rows of this table; a new parallelism adds a mesh axis and rows.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical name -> mesh axis (or tuple of axes, or None = replicated). Every logical name used by
# the model must appear: flax treats an unknown name as a mesh-axis name and fails.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    ("lora_rank", None),  # LoRA adapters: the rank dim is small; shard only their I/O dims
    # activations: the batch is split over every data-parallel axis; the model dim is whole on
    # each device between layers (fsdp gathers weights, not activations).
    ("act_batch", BATCH_AXES),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)
_RULES = dict(LOGICAL_RULES)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None, *, dcn_data: int = 1,
              dcn_fsdp: int = 1) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all). One size may be -1 (the rest).

  With dcn_data or dcn_fsdp > 1 the mesh is hybrid: the devices form dcn_data*dcn_fsdp groups
  (TPU slices, or processes where devices have no slices, as on GPU hosts and CPU), each laid
  out as (data/dcn_data, fsdp/dcn_fsdp, tensor) over its fast interconnect (ICI, NVLink), and
  the groups are tiled along data and fsdp, so only those axes cross the slower data-center
  network. Tensor parallelism never leaves a group.

  Axes are Auto (GSPMD propagation): the model states shardings for params and a few activation
  constraints, and XLA chooses the collectives.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} "
                     f"tensor={tensor}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"mesh sizes {sizes} cannot fill {len(devices)} devices")
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f"mesh data*fsdp*tensor={sizes} has {int(np.prod(sizes))} devices, but "
                     f"{len(devices)} are present")
  axis_types = (AxisType.Auto,) * 3
  if dcn_data * dcn_fsdp == 1:
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=axis_types, devices=devices)
  if sizes[0] % dcn_data or sizes[1] % dcn_fsdp:
    raise ValueError(f"mesh data={sizes[0]} fsdp={sizes[1]} is not divisible by dcn_data="
                     f"{dcn_data} dcn_fsdp={dcn_fsdp}")
  ici = (sizes[0] // dcn_data, sizes[1] // dcn_fsdp, sizes[2])
  grid = mesh_utils.create_hybrid_device_mesh(
      ici, (dcn_data, dcn_fsdp, 1), devices, process_is_granule=num_slices(devices) == 1)
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def platform_of_backend(name: str) -> str:
  """"cpu", "gpu" or "tpu" from a JAX backend or device platform name ("cuda", "rocm", ...)."""
  return "gpu" if name in ("gpu", "cuda", "rocm") else name


def mesh_platform(mesh: Mesh) -> str:
  """What a program over `mesh` compiles for: its devices' platform ("cpu", "gpu", "tpu").

  Deviceless targets (jax.experimental.topologies) give TPU or GPU devices in a CPU process,
  so code that picks a kernel asks the mesh, never `jax.default_backend()`.
  """
  return platform_of_backend(mesh.devices.flat[0].platform)


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
