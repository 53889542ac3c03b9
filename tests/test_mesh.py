"""The mesh as data: axes by name, one resolver, divisibility rules derived from LOGICAL_RULES."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxtrain.parallel.mesh import (BATCH_AXES, LOGICAL_RULES, MESH_AXES, MeshShape, check_divides,
                           hybrid_device_grid, make_mesh, resolve_shape)


def test_sizes_are_looked_up_by_name_and_unnamed_axes_are_1():
  shape = MeshShape(fsdp=4, tensor=2)
  assert shape["fsdp"] == shape.fsdp == 4 and shape["data"] == 1
  assert shape.items() == tuple((a, {"fsdp": 4, "tensor": 2}.get(a, 1)) for a in MESH_AXES)
  assert shape.batch_shards == 4 and shape.describe() == "data=1 stage=1 fsdp=4 expert=1 context=1 tensor=2"
  assert MeshShape({"fsdp": 4}, tensor=2) == shape and hash(MeshShape(fsdp=4, tensor=2))
  with pytest.raises(ValueError, match="unknown mesh axes"):
    MeshShape(pipeline=2)


def test_resolve_fills_the_one_free_axis():
  assert resolve_shape({"data": 2, "fsdp": -1, "tensor": 2}, 8) == MeshShape(data=2, fsdp=2,
                                                                             tensor=2)
  with pytest.raises(ValueError, match="only one mesh axis may be -1"):
    resolve_shape({"data": -1, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match="8 devices are present"):
    resolve_shape({"data": 2, "fsdp": 2, "tensor": 1}, 8)


def test_divisibility_rules_come_from_the_sharding_table():
  dims = {"model.vocab_size": 384, "model.d_model": 128, "model.mlp_dim": 384,
          "model.num_heads": 4, "model.num_kv_heads": 2}
  check_divides(MeshShape(fsdp=4, tensor=2), dims)
  # Every mesh axis that LOGICAL_RULES lets shard a parameter dim is checked against it.
  sharding = {dict(LOGICAL_RULES)[n] for n in ("vocab", "embed", "mlp", "heads", "kv_heads")}
  assert sharding == {"tensor", ("fsdp", "context", "expert")}
  with pytest.raises(ValueError, match=r"mesh.tensor=4: does not divide model.num_kv_heads=2"):
    check_divides(MeshShape(tensor=4), dims)
  with pytest.raises(ValueError, match=r"mesh.fsdp=3: does not divide model.d_model=128"):
    check_divides(MeshShape(fsdp=3), dims)
  # Axes that shard one dim together must divide it together: d_model over fsdp and context.
  check_divides(MeshShape(fsdp=4, context=2), {**dims, "model.d_model": 8})
  with pytest.raises(ValueError, match=r"mesh.fsdp\*mesh.context=4\*4=16: does not divide "
                                       r"model.d_model=8; use sizes whose product divides it"):
    check_divides(MeshShape(fsdp=4, context=4), {**dims, "model.d_model": 8})
  # The experts of an MoE model split over `expert`; a dense model (no key, or 0) has none.
  check_divides(MeshShape(expert=4, fsdp=2), {**dims, "moe.num_experts": 0})
  with pytest.raises(ValueError, match=r"mesh.expert=3: does not divide moe.num_experts=8"):
    check_divides(MeshShape(expert=3), {**dims, "model.d_model": 96, "moe.num_experts": 8})


def test_make_mesh_defaults_to_fsdp_and_keeps_tensor_within_a_host_group():
  mesh = make_mesh(devices=jax.devices()[:4])
  assert dict(mesh.shape) == {"data": 1, "stage": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
  assert mesh.axis_names == MESH_AXES and set(BATCH_AXES) <= set(MESH_AXES)
  with pytest.raises(ValueError, match="may span host groups"):
    make_mesh({"tensor": 8}, dcn={"tensor": 2})


def test_dcn_stage_puts_each_stage_within_one_host_group():
  """8 devices on 2 hosts, stage=2 with dcn_stage=2 and fsdp=4: each stage's fsdp group is one
  host's devices, so only the pipeline's activations cross hosts. (Fake devices: one process
  here cannot form two host groups; the layout is what make_mesh builds its Mesh from.)"""
  @dataclasses.dataclass(frozen=True)
  class HostDevice:
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"
  devices = [HostDevice(i, i // 4) for i in range(8)]
  grid = hybrid_device_grid(MeshShape(stage=2, fsdp=4), devices, {"stage": 2})
  hosts_SF = np.vectorize(lambda d: d.process_index)(grid).reshape(2, 4)
  assert hosts_SF.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
  # Across hosts by fsdp instead: every stage spans both hosts.
  grid = hybrid_device_grid(MeshShape(stage=2, fsdp=4), devices, {"fsdp": 2})
  assert np.vectorize(lambda d: d.process_index)(grid).reshape(2, 4).tolist() == [[0, 0, 1, 1]] * 2
  with pytest.raises(ValueError, match="may span host groups"):
    hybrid_device_grid(MeshShape(context=8), devices, {"context": 2})
