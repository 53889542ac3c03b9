"""Collective bytes of a compiled program (train/hlo_collectives.py) and the dry run's
collectives section (dryrun/interconnect.py): hand-written HLO in the forms XLA prints (sync and
async, tuples, loops, conditionals, the three replica-group notations), a real compile on this
process's CPU devices, the section for every chip of the table, and the command's report."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import hardware as targets
from jaxtrain.config import load_config_file
from jaxtrain.dryrun import command, interconnect
from jaxtrain.hardware import format_bytes
from jaxtrain.train import hlo_collectives
from tests.dry_run_helpers import DRY_RUN_LAST_LINE, run_dry_run
from tests.helpers import REPO, run_cli

_ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

SYNC = """HloModule sync, num_partitions=8
""" + _ADD + """
ENTRY %main (p: f32[16,8], h: bf16[16,8]) -> f32[16,8] {
  %p = f32[16,8]{1,0} parameter(0)
  %h = bf16[16,8]{1,0} parameter(1)
  %ar = f32[16,8]{1,0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ag = bf16[64,8] all-gather(%h), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %rs = f32[4,8] reduce-scatter(%p), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %a2a = (f32[4,8], f32[4,8]) all-to-all(%rs, %rs), replica_groups={{0,1},{2,3},{4,5},{6,7}}
  %cp = f32[16,8]{1,0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
  ROOT %out = f32[16,8]{1,0} add(%ar, %cp)
}
"""


def _rows(found):
  return {k.kind: (k.executed, k.bytes, k.link_bytes, k.group_sizes) for k in found.kinds}


def test_sync_collectives_bytes_groups_and_ring_shares():
  """all-reduce: the operand, 2(n-1)/n over the link; all-gather: the gathered result;
  reduce-scatter: its input (n x the result); a tuple all-to-all: its elements summed; a
  permute: all of its operand."""
  assert _rows(hlo_collectives.count(SYNC)) == {
      "all-gather": (1, 64 * 8 * 2, 64 * 8 * 2 * 3 / 4, (4,)),
      "reduce-scatter": (1, 16 * 8 * 4, 16 * 8 * 4 * 3 / 4, (4,)),
      "all-reduce": (1, 16 * 8 * 4, 16 * 8 * 4 * 2 * 3 / 4, (4,)),
      "all-to-all": (1, 2 * 4 * 8 * 4, 2 * 4 * 8 * 4 / 2, (2,)),
      "collective-permute": (1, 16 * 8 * 4, 16 * 8 * 4, ()),
  }


ASYNC = """HloModule async, is_scheduled=true, num_partitions=8
""" + _ADD + """
ENTRY %main (a: bf16[2,8], b: bf16[2,8], p: f32[16,8], v: f32[8], c: f32[]) -> f32[8] {
  %a = bf16[2,8]{1,0} parameter(0)
  %b = bf16[2,8]{1,0} parameter(1)
  %p = f32[16,8]{1,0} parameter(2)
  %v = f32[8]{0} parameter(3)
  %c = f32[] parameter(4)
  %ags = ((bf16[2,8], bf16[2,8]), (bf16[16,8], bf16[16,8])) all-gather-start(%a, %b), \
replica_groups=mesh['x'=8,'y'=1] {'x'}, dimensions={0}
  %agd = (bf16[16,8]{1,0}, bf16[16,8]{1,0}) all-gather-done(%ags)
  %rss = ((f32[16,8]), f32[4,8]) reduce-scatter-start(%p), \
replica_groups=mesh['x'=2,'y'=4] {'y'}, dimensions={0}, to_apply=%add
  %rsd = f32[4,8]{1,0} reduce-scatter-done(%rss)
  %ars = f32[8]{0} all-reduce-start(%v), replica_groups=[1,8]<=[8], to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %ars2 = ((f32[8]{0}, f32[]), (f32[8]{0}, f32[])) all-reduce-start(%v, %c), \
replica_groups=[1,8]<=[8], to_apply=%add
  %ard2 = (f32[8]{0}, f32[]) all-reduce-done(%ars2)
  %cps = (f32[8]{0}, f32[8]{0}) collective-permute-start(%v), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8]{0} collective-permute-done(%cps)
  %aas = ((f32[16,8]), f32[16,8]) all-to-all-start(%p), replica_groups={{0,1,2,3,4,5,6,7}}, \
dimensions={0}
  %aad = f32[16,8]{1,0} all-to-all-done(%aas)
  ROOT %out = f32[8]{0} add(%ard, %cpd)
}
"""


def test_async_start_done_pairs_count_the_start_and_its_result():
  """XLA:GPU's `-start`/`-done` pairs: the start counted once, the done not; the start's shape
  holds (operands, result): a combined all-gather's results summed, reduce-scatter's input
  read as n x its result; all-reduce-start is its result alone in jax 0.10's XLA, (operands,
  result) in jax 0.12's (here combined: two arrays)."""
  assert _rows(hlo_collectives.count(ASYNC)) == {
      "all-gather": (1, 2 * 16 * 8 * 2, 2 * 16 * 8 * 2 * 7 / 8, (8,)),
      "reduce-scatter": (1, 16 * 8 * 4, 16 * 8 * 4 * 3 / 4, (4,)),
      "all-reduce": (2, 32 + 36, (32 + 36) * 2 * 7 / 8, (8,)),
      "all-to-all": (1, 16 * 8 * 4, 16 * 8 * 4 * 7 / 8, (8,)),
      "collective-permute": (1, 32, 32, ()),
  }


LOOPS = """HloModule loops, num_partitions=8
""" + _ADD + """
%inner (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %y = f32[8]{0} get-tuple-element(%q), index=1
  %ag = f32[8]{0} all-gather(%y), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  ROOT %t = (s32[], f32[8]{0}) tuple(%j, %ag)
}

%inner_cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

%outer (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=2, replica_groups={}, to_apply=%add
  %w = (s32[], f32[8]{0}) while(%p), condition=%inner_cond, body=%inner
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%outer_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%small (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}

%big (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %y = f32[8]{0} all-reduce(%x), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  ROOT %z = f32[8]{0} all-reduce(%y), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}

ENTRY %main (s: (s32[], f32[8]), k: s32[], x: f32[8]) -> (s32[], f32[8]) {
  %s = (s32[], f32[8]{0}) parameter(0)
  %k = s32[] parameter(1)
  %x = f32[8]{0} parameter(2)
  %branch = f32[8]{0} conditional(%k, %x, %x), branch_computations={%small, %big}
  ROOT %w = (s32[], f32[8]{0}) while(%s), condition=%outer_cond, body=%outer, \
backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_loop_bodies_count_once_per_iteration_and_a_conditional_its_costliest_branch():
  """An outer loop of 3 (known_trip_count) around an all-reduce over all 8 devices
  (`replica_groups={}`) and an inner loop of 5 (libtpu's form: the trip count from the
  condition's constant) around an all-gather in groups of 2 (a transposed iota); a conditional
  counts its branch with two all-reduces."""
  assert _rows(hlo_collectives.count(LOOPS)) == {
      "all-gather": (15, 15 * 32, 15 * 32 / 2, (2,)),
      "all-reduce": (3 + 2, 3 * 32 + 2 * 32, 3 * 32 * 2 * 7 / 8 + 2 * 32, (2, 8)),
  }


@pytest.mark.parametrize("text, size", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}", 2),
    ("replica_groups=[2,4]<=[8], use_global_device_ids=true", 4),
    ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 2),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add", 4),
    ("replica_groups=mesh['a'=2,'b'=4] {'a','b'}, to_apply=%add", 8),
    ("replica_groups=mesh['axis_0'=8,'axis_1'=8,'axis_2'=16] {'axis_0':(2)4,'axis_1':(2)4}", 16),
    ("replica_groups=mesh[axis_0=8,axis_1=8,axis_2=16] {axis_0:(2)4,axis_2}", 64),
    ("replica_groups={}, to_apply=%add", 8),
    ("channel_id=1, to_apply=%add", 8),
])
def test_replica_group_sizes_in_every_notation(text, size):
  assert hlo_collectives.group_size(text, devices=8) == size


def test_types_tuples_and_sub_byte_elements():
  assert hlo_collectives.array_bytes("(bf16[4,8]{1,0}, f32[])") == 68
  assert hlo_collectives.array_bytes("s4[16]{0:E(4)}") == 8
  assert hlo_collectives.array_bytes("pred[3]") == 3
  assert hlo_collectives.tuple_elements("((f32[2]{0}, s8[3]), bf16[1,2]{1,0}, u32[])") == [
      "(f32[2]{0}, s8[3])", "bf16[1,2]{1,0}", "u32[]"]


def test_a_real_compile_on_cpu_devices():
  """shard_map on 2 x 4 of this process's CPU devices: each collective once on the [8, 8]
  float32 shard (256 bytes), and a scan of 5 with a scalar psum over all 8 inside; jax 0.10
  prints explicit replica groups here, jax 0.12 mesh-axes and iota ones."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

  def f(x):
    def body(c, _):
      return c + jax.lax.psum(c.sum(), ("a", "b")), None
    out = [jax.lax.psum(x, "b"), jax.lax.all_gather(x, "a", tiled=True),
           jax.lax.psum_scatter(x, "b", tiled=True), jax.lax.all_to_all(x, "b", 0, 0, tiled=True),
           jax.lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)]),
           jax.lax.scan(body, x, None, length=5)[0]]
    return sum(o.sum() for o in out)

  g = jax.shard_map(f, mesh=mesh, in_specs=P("a", "b"), out_specs=P(), check_vma=False)
  x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))
  found = hlo_collectives.count(jax.jit(g).lower(x).compile().as_text())
  shard = 8 * 8 * 4
  assert _rows(found) == {
      "all-gather": (1, 2 * shard, shard, (2,)),
      "reduce-scatter": (1, shard, shard * 3 / 4, (4,)),
      "all-reduce": (1 + 5, shard + 5 * 4, shard * 2 * 3 / 4 + 5 * 4 * 2 * 7 / 8, (4, 8)),
      "all-to-all": (1, shard, shard * 3 / 4, (4,)),
      "collective-permute": (1, shard, shard, ()),
  }


def _measurement(hlo, num_devices=8, flops=1e12):
  """What interconnect.section reads of a Measurement."""
  return types.SimpleNamespace(
      hlo=hlo, flops=flops, num_devices=num_devices, backend="gpu", platform="gpu",
      model_cfg=types.SimpleNamespace(runtime=types.SimpleNamespace(matmul_precision="none")))


# SYNC's collectives a million times over (milliseconds on every link).
BIG = (SYNC.replace("[16,8]", "[16384,8192]").replace("[64,8]", "[65536,8192]")
       .replace("[4,8]", "[4096,8192]"))


@pytest.mark.parametrize("chip", targets.CHIPS, ids=lambda c: c.key)
def test_the_section_times_the_collectives_on_every_chip(chip):
  """NVLink, PCIe and ICI: each kind's bytes over the link at the chip's rate per device (v7x's
  two TensorCores share their chip's), the total, and the matmuls at the chip's peak."""
  sep = "x" if chip.compiler == "gpu" else "-"
  target = targets.parse(f"{chip.key}{sep}{chip.counts[min(3, len(chip.counts) - 1)]}")
  lines = interconnect.section(_measurement(BIG), target)
  assert lines[1] == interconnect.HEADER and "ESTIMATE" in lines[1]
  assert lines[2] == f"  link: {chip.interconnect.describe()}"
  rate = chip.interconnect.bytes_per_s / chip.devices_per_chip
  found = hlo_collectives.count(BIG)
  assert found.bytes == 1024 ** 2 * hlo_collectives.count(SYNC).bytes
  rows = {line.split()[0]: line for line in lines[4:]}
  for k in found.kinds:
    assert rows[k.kind].endswith(interconnect.format_seconds(k.link_bytes / rate)), rows[k.kind]
    assert format_bytes(k.bytes) in rows[k.kind]
  assert rows["total"].endswith(interconnect.format_seconds(found.link_bytes / rate))
  assert f"{chip.peak_bf16_flops / 1e12:,.0f} TFLOP/s" in rows["matmuls"]
  assert rows["matmuls"].endswith(interconnect.format_seconds(1e12 / chip.peak_bf16_flops))
  assert "collectives dominate" in "\n".join(lines) or "compute dominates" in "\n".join(lines)


def test_the_section_without_a_target_has_bytes_only_and_one_device_none():
  lines = interconnect.section(_measurement(SYNC), None)
  assert "no target chip" in lines[1] and "time" not in lines[2].split()
  assert not any("at peak" in line for line in lines)
  assert interconnect.section(_measurement("HloModule m\n", num_devices=1), None) == [
      "", "collectives per step: none in the compiled program (one device)"]


def test_cli_dry_run_without_a_target_prints_the_bytes():
  """--dry_run_devices=2 (XLA:CPU, no target chip): fsdp over 2 devices gathers the weights
  (all-gather) and reduces the gradients (XLA:CPU by all-reduce; XLA:GPU makes reduce-scatters of
  them: tests/test_shipped_configs.py); the rows are the compiled step's counts."""
  run = run_dry_run("--config=configs/tiny.py", "--dry_run_devices=2",
                    "--config.train.global_batch_size=2", devices=2)
  assert run.cli.returncode == 0, run.cli.stderr[-3000:]
  lines = run.cli.stdout.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("collectives per step"))
  assert "no target chip" in lines[start]
  found = hlo_collectives.count(run.measurements[0].hlo)
  assert {"all-gather", "all-reduce"} <= {k.kind for k in found.kinds}
  for k in found.kinds:
    row = next(line for line in lines[start:] if line.split()[0] == k.kind).split()
    assert row[1:3] == [f"{k.executed:,}", "2"]
    assert " ".join(row[3:5]) == format_bytes(k.bytes)
  assert DRY_RUN_LAST_LINE.match(lines[-1])


@pytest.mark.slow(seconds=30)
def test_cli_dry_run_on_pcie_with_tensor_parallelism_compiles_fsdp_instead():
  """rtx4090x2 with mesh.tensor=2 (XLA's GPU compiler, no GPU): the section times the
  collectives at PCIe 4.0 x16's rate, and the same 2 cards on fsdp, compiled too, move fewer
  bytes; both as the compiled programs' counts."""
  target = targets.parse("rtx4090x2")
  if targets.compiler_missing(target):
    pytest.skip(targets.compiler_missing(target))
  run = run_dry_run("--config=configs/tiny.py", "--dry_run_target=rtx4090x2",
                    "--config.mesh.tensor=2", "--config.mesh.fsdp=1", "--config.mesh.data=1")
  out = run.cli.stdout
  assert run.cli.returncode == 0, run.cli.stderr[-3000:]
  assert interconnect.HEADER in out and "  link: PCIe 4.0 x16, 31.5 GB/s per direction" in out
  base, other = run.measurements
  assert (base.mesh.tensor, other.mesh.tensor, other.mesh.fsdp) == (2, 1, 2)
  rate = target.chip.interconnect.bytes_per_s
  mine, theirs = hlo_collectives.count(base.hlo), hlo_collectives.count(other.hlo)
  section = out[out.index(interconnect.HEADER):].splitlines()
  total = next(line for line in section if line.startswith("  total"))
  assert total.endswith(interconnect.format_seconds(mine.link_bytes / rate))
  block = out[out.index("on PCIe, fsdp instead of tensor"):]
  assert "--config.mesh.fsdp=2 --config.mesh.tensor=1" in block
  assert re.search(rf"{re.escape(format_bytes(theirs.link_bytes))} over the link, "
                   rf"~{re.escape(interconnect.format_seconds(theirs.link_bytes / rate))}", block)
  assert f"against {format_bytes(mine.link_bytes)}" in block
  assert theirs.link_bytes < mine.link_bytes
  assert DRY_RUN_LAST_LINE.match(out.splitlines()[-1])


def test_no_fsdp_alternative_without_a_pcie_target():
  """The fsdp alternative is for PCIe targets only: here the mesh as given, compiled once."""
  proc = run_cli("--config=configs/tiny.py", "--dry_run", "--dry_run_devices=2",
                 "--config.mesh.tensor=2", "--config.mesh.fsdp=1", devices=2)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "fsdp instead of tensor" not in proc.stdout


def test_suggestions_on_pcie_carry_each_compiled_options_collectives(monkeypatch):
  """A PCIe target (rtx4090x2, modelled by XLA:CPU on 2 of this process's devices) that nothing
  fits: every compiled option says what its step moves over the link and how long that takes;
  the exact and estimated ones, which compile nothing, say nothing."""
  target = targets.parse("rtx4090x2")
  config = load_config_file(f"{REPO}/configs/tiny.py")
  config.train.global_batch_size = 2
  config.model.remat_policy = "minimal"  # the full-remat option compiles
  monkeypatch.setattr(command, "memories_for", lambda target, config: {"Tiny 1KiB": 1024})
  lines = []
  result = command.run(config, jax.devices()[:2], target, "tiny", out=lines.append)
  compiled = [o for o in result.options if o.how == "compiled"]
  assert compiled and all(o.measured is not None for o in compiled)
  for option in result.options:
    if option in compiled:
      assert option.collectives == interconnect.brief(option.measured, target)
      assert f"      collectives: {option.collectives}" in lines
      assert "at 31.5 GB/s" in option.collectives
    else:
      assert not option.collectives
