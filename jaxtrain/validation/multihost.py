"""Validation of a run across processes and hosts: the mesh axes split over host groups
(mesh.dcn_*), the data shards against the processes, and the distributed.* timeouts."""

from __future__ import annotations

import math

from jaxtrain.config import ConfigError
from jaxtrain.parallel.mesh import DCN_AXES, MeshShape


def check_multihost(config, mesh: MeshShape, num_processes: int | None, num_slices: int):
  """mesh.dcn_*, data.num_shards and distributed.* (see default_config)."""
  dcn = {}
  for axis in DCN_AXES:  # the axes that may span host groups (mesh.make_mesh)
    size, whole = config.mesh[f"dcn_{axis}"], mesh[axis]
    if not isinstance(size, int) or size < 1:
      raise ConfigError(f"mesh.dcn_{axis}={size}: must be a positive number of host groups (1: "
                        f"the {axis} axis stays within each host or slice)")
    if whole % size:
      raise ConfigError(f"mesh.dcn_{axis}={size}: does not divide mesh.{axis}={whole}; the "
                        f"{axis} axis is split into {size} groups across hosts, so make "
                        f"mesh.{axis} a multiple of {size}, e.g. --config.mesh.{axis}={size}")
    dcn[axis] = size
  keys = "*".join(f"mesh.dcn_{a}" for a in DCN_AXES)
  values = "*".join(str(dcn[a]) for a in DCN_AXES)
  product = math.prod(dcn.values())
  if num_processes is not None and (product > 1 or num_slices > 1):
    groups, what = (num_slices, "TPU slices") if num_slices > 1 else (num_processes, "processes")
    if groups == 1:
      raise ConfigError(f"{keys}={values}={product}: this run is a single process, with no "
                        f"other hosts to span; set "
                        f"{', '.join(f'mesh.dcn_{a}=1' for a in DCN_AXES)} (for multi-process "
                        f"runs)")
    if product != groups:
      flat = "" if num_slices > 1 else ", or all 1 for one flat mesh over all devices"
      raise ConfigError(f"{keys}={values}={product}, but this run has {groups} {what}; make the "
                        f"product {groups} (e.g. --config.mesh.dcn_data={groups} with mesh.data "
                        f"a multiple of it, or --config.mesh.dcn_stage={groups} to put pipeline "
                        f"stages across them){flat}")
  batch, shards = config.train.global_batch_size, config.data.num_shards
  if not isinstance(shards, int) or shards < 0:
    raise ConfigError(f"data.num_shards={shards}: must be >= 0 (0: one shard per process)")
  if shards and batch % shards:
    raise ConfigError(f"data.num_shards={shards}: must divide train.global_batch_size={batch} "
                      f"(each shard gives global_batch_size/num_shards rows of every batch); "
                      f"e.g. {largest_divisor(batch, shards)}")
  if num_processes is not None and num_processes > 1:
    if shards and shards % num_processes:
      raise ConfigError(f"data.num_shards={shards}: must be a multiple of the {num_processes} "
                        f"processes, so each reads whole shards; e.g. {num_processes} or "
                        f"{2 * num_processes}")
    if not shards and batch % num_processes:
      raise ConfigError(f"train.global_batch_size={batch}: must be divisible by the "
                        f"{num_processes} processes (data.num_shards=0: one shard per process); "
                        f"use a multiple of {num_processes}")
  check_distributed(config)


def check_distributed(config):
  """distributed.*: checked by validate() and, before JAX starts, by the CLI."""
  for key in ("heartbeat_timeout_s", "initialization_timeout_s", "shutdown_timeout_s"):
    value = config.distributed[key]
    if not isinstance(value, (int, float)) or value < 1:
      raise ConfigError(f"distributed.{key}={value}: must be at least 1 (seconds)")


def largest_divisor(value: int, limit: int) -> int:
  return max(d for d in range(1, limit + 1) if value % d == 0)
