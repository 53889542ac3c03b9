"""FP8 matmuls (jaxtrain/fp8.py): error within the formats' rounding bounds, zeros, very large
values, scales, gradients; and a model step under `precision.matmul=fp8`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import fp8, train_setup, trainer
from tests.helpers import mesh_of, packed_batch, small_config, train_curves

E4M3_UNIT = 2.0 ** -4  # e4m3: 3 mantissa bits, round to nearest
E5M2_UNIT = 2.0 ** -3  # e5m2: 2 mantissa bits
# Half the spacing of the subnormals, relative to the scale (the largest value maps to the max).
E4M3_TINY = 2.0 ** -10
E5M2_TINY = 2.0 ** -17


def _rounding_bound(v, unit, tiny):
  """Largest error of each element of v after scaling to the format and back."""
  v = np.abs(np.asarray(v, np.float64))
  return np.maximum(unit * v, tiny * v.max())


def _product_bound(a, ea, b, eb):
  """Bound on |a' @ b' - a @ b| with |a' - a| <= ea, |b' - b| <= eb elementwise."""
  a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
  return a @ eb + ea @ b + ea @ eb


def _operands(seed, n=48, i=96, o=40):
  rng = np.random.default_rng(seed)
  # Magnitudes over several orders, as activations have.
  x = rng.normal(size=(n, i)) * np.exp(rng.normal(size=(n, i)))
  return jnp.asarray(x, jnp.float32), jnp.asarray(rng.normal(size=(i, o)), jnp.float32)


@pytest.mark.parametrize("scale", [1.0, 1e-6, 1e20])
def test_forward_error_within_e4m3_bounds(scale):
  x, w = _operands(0)
  x = x * scale
  y = np.asarray(fp8.matmul(x, w, jnp.float32), np.float64)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  bound = _product_bound(x, _rounding_bound(x, E4M3_UNIT, E4M3_TINY),
                         w, _rounding_bound(w, E4M3_UNIT, E4M3_TINY))
  # Plus float32 accumulation, far below the FP8 rounding.
  assert np.all(np.abs(y - want) <= bound * 1.001 + 1e-5 * np.abs(want)), np.max(
      np.abs(y - want) / bound)
  assert np.isfinite(y).all()
  # Typical error: a few percent of the result's scale, not the worst case.
  assert np.linalg.norm(y - want) / np.linalg.norm(want) < 0.05


def test_gradients_within_e5m2_and_e4m3_bounds():
  x, w = _operands(1)
  g = jnp.asarray(np.random.default_rng(2).normal(size=(x.shape[0], w.shape[1])), jnp.float32)
  _, vjp = jax.vjp(lambda a, b: fp8.matmul(a, b, jnp.float32), x, w)
  dx, dw = (np.asarray(t, np.float64) for t in vjp(g))
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  ex, ew = (_rounding_bound(t, E4M3_UNIT, E4M3_TINY) for t in (x64, w64))
  eg = _rounding_bound(g64, E5M2_UNIT, E5M2_TINY)
  assert np.all(np.abs(dx - g64 @ w64.T) <= _product_bound(g64, eg, w64.T, ew.T) * 1.001)
  assert np.all(np.abs(dw - x64.T @ g64) <= _product_bound(x64.T, ex.T, g64, eg) * 1.001)
  assert np.linalg.norm(dx - g64 @ w64.T) / np.linalg.norm(g64 @ w64.T) < 0.15
  assert np.linalg.norm(dw - x64.T @ g64) / np.linalg.norm(x64.T @ g64) < 0.15


def test_zeros_give_zeros_and_finite_gradients():
  x, w = jnp.zeros((8, 16)), jnp.ones((16, 4))
  y, vjp = jax.vjp(lambda a, b: fp8.matmul(a, b, jnp.float32), x, w)
  dx, dw = vjp(jnp.ones_like(y))
  assert not np.asarray(y).any() and np.isfinite(dx).all() and not np.asarray(dw).any()
  assert float(fp8.scale_of(x, fp8.E4M3)) == 1.0


def test_scales_map_the_largest_magnitude_to_the_formats_largest_value():
  x = jnp.asarray([[-3.0, 0.5], [1.0, 2.0]])
  for dtype, top in ((fp8.E4M3, 448.0), (fp8.E5M2, 57344.0)):
    q, s = fp8.quantize(x, dtype)
    assert q.dtype == dtype and float(s) == np.float32(3.0 / top)
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == top
    assert float(q[0, 0].astype(jnp.float32)) == -top


def test_outputs_and_gradients_keep_their_dtypes():
  x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.float32)
  y, vjp = jax.vjp(lambda a, b: fp8.matmul(a, b, jnp.bfloat16), x, w)
  dx, dw = vjp(jnp.ones_like(y))
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)


def _small(precision, **model):
  config = small_config(**model)
  config.precision.matmul = precision
  return config


def test_every_projection_runs_in_fp8_forward_and_backward():
  """Unrolled layers without remat: each layer's 7 projections (q, k, v, o, gate, up, down) are
  3 FP8 dots each (the forward, and the backward's two), e4m3 by e4m3 forward and e5m2 by e4m3
  backward; the output head stays in the compute dtype."""
  config = _small("fp8", scan_layers=False, remat_policy="none")
  layers = config.model.num_layers
  assert _lowered_fp8_dots(config) == (7 * layers, 14 * layers)


def _lowered_fp8_dots(config) -> tuple[int, int]:
  """(e4m3 x e4m3 dots, dots with an e5m2 operand) of the lowered train step of `config`."""
  setup = train_setup.build(config, mesh_of({}))
  state = train_setup.abstract_state(setup, 0)
  batch = trainer.to_global_batch(packed_batch(config.train.global_batch_size,
                                               config.train.seq_len, config.model.vocab_size),
                                  setup.mesh)
  with jax.set_mesh(setup.mesh):
    text = setup.train_step.lower(state, batch).as_text()
  dots = re.findall(r"stablehlo.dot_general.*", text)
  return (sum(d.count("f8E4M3FN>") >= 2 for d in dots),
          sum("f8E5M2>" in d and "f8E4M3FN>" in d for d in dots))


def test_fp8_training_follows_the_default_run():
  """A few steps of the small model: the FP8 losses within 1% of the compute dtype's."""
  base = train_curves(_small("none"), {}, steps=4)
  low = train_curves(_small("fp8"), {}, steps=4)
  np.testing.assert_allclose(low["loss"], base["loss"], rtol=1e-2)
  assert np.isfinite(low["grad_norm"]).all()


def test_an_unknown_matmul_precision_is_a_one_line_error():
  from tests.helpers import assert_one_line_config_error  # pylint: disable=import-outside-toplevel
  assert_one_line_config_error(_small("fp4"), 1, ["precision.matmul='fp4'", "none, fp8"])


HLO = """HloModule m
%gemm_fusion (p0: f8e4m3fn[4,8], p1: f8e5m2[8,2]) -> bf16[4,2] {
  %p0 = f8e4m3fn[4,8]{1,0} parameter(0)
  %p1 = f8e5m2[8,2]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main (a: f8e4m3fn[4,8], b: f8e4m3fn[8,2], c: bf16[2,3]) -> bf16[4,3] {
  %a = f8e4m3fn[4,8]{1,0} parameter(0)
  %b = f8e4m3fn[8,2]{1,0} parameter(1)
  %c = bf16[2,3]{1,0} parameter(2)
  %dot.2 = bf16[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %dot.3 = bf16[4,3]{1,0} dot(%dot.2, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_hlo_dots_are_counted_by_operand_types():
  from jaxtrain.dryrun import hlo_dots, hlo_flops  # pylint: disable=import-outside-toplevel
  counts = hlo_dots.dot_operand_types(HLO)
  assert counts == {("f8e4m3fn", "f8e5m2"): 1, ("f8e4m3fn", "f8e4m3fn"): 1, ("bf16", "bf16"): 1}
  assert hlo_dots.fp8_dots(counts) == (1, 1)
  assert hlo_dots.describe(counts) == ("1 e4m3 x e4m3 (forward), 1 with an e5m2 gradient "
                                       "(backward), 1 in bf16")
  # FLOPs of FP8 dots count like any others' (2 * outputs * contracted size): the entry's two
  # (the fusion computation is called from nowhere here, so it runs 0 times).
  assert hlo_flops.count(HLO).flops == 2 * (4 * 2) * 8 + 2 * (4 * 3) * 2


@pytest.mark.slow(seconds=20)
def test_llama8b_fp8_step_for_h100_multiplies_every_projection_in_fp8(tmp_path):
  """`--dry_run --dry_run_hlo` of configs/llama8b.py with precision.matmul=fp8, compiled by
  XLA's GPU compiler for h100x8: it fits, and the optimized HLO's scanned layer multiplies each
  of its 7 projections in FP8 three times (e4m3 x e4m3 forward; the input and weight gradients
  with the e5m2 output gradient); only the output head's matmuls stay in bfloat16."""
  from jaxtrain.dryrun import hlo_dots, targets  # pylint: disable=import-outside-toplevel
  from tests.helpers import run_cli  # pylint: disable=import-outside-toplevel
  missing = targets.compiler_missing(targets.parse("h100x8"))
  if missing:
    pytest.skip(missing)
  path = tmp_path / "step.hlo.txt"
  proc = run_cli("--config=configs/llama8b.py", "--config.precision.matmul=fp8", "--dry_run",
                 f"--dry_run_hlo={path}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert "fits=yes" in last and "compiler=gpu" in last, last
  counts = hlo_dots.dot_operand_types(path.read_text())
  assert hlo_dots.fp8_dots(counts) == (7, 14), counts
  assert counts[("bf16", "bf16")] == 3, counts  # the head: forward, and its two gradients
  assert "matmuls       fp8: 7 e4m3 x e4m3 (forward), 14 with an e5m2" in proc.stdout


@pytest.mark.parametrize("target", ["a100x8", "v5p-8", "v6e-8"])
def test_fp8_on_a_target_without_fp8_units_is_refused_in_one_line(target):
  from tests.helpers import run_cli  # pylint: disable=import-outside-toplevel
  proc = run_cli("--config=configs/tiny.py", "--config.precision.matmul=fp8", "--dry_run",
                 f"--dry_run_target={target}")
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "has no FP8 matmul units" in lines[0], proc.stderr
  assert "targets that have them: h100, h200, b200, l4" in lines[0]


def test_mfu_is_against_the_peak_of_the_precision_in_use():
  from jaxtrain.dryrun import targets  # pylint: disable=import-outside-toplevel
  kind = "NVIDIA H100 80GB HBM3"
  assert targets.chip_for_device_kind(kind) == ("NVIDIA H100 80GB (SXM)", 989e12)
  assert targets.chip_for_device_kind(kind, "fp8") == ("NVIDIA H100 80GB (SXM)", 1979e12)
  assert targets.chip_for_device_kind("NVIDIA A100-SXM4-80GB", "fp8")[1] == 0
  assert targets.chip_for_device_kind("NVIDIA H100 PCIe", "fp8")[1] == 1513e12


@pytest.mark.slow(seconds=8)
def test_tpu7x_compiles_the_fp8_projections_as_fp8_matmuls(tmp_path):
  """libtpu's compiler for TPU v7x (deviceless) keeps the tiny model's projections FP8: the
  scanned layer's 7 forward matmuls e4m3 x e4m3 and 14 backward ones with the e5m2 gradient
  (as `convolution`s, its form of a matmul)."""
  from jaxtrain.dryrun import hlo_dots, targets  # pylint: disable=import-outside-toplevel
  from tests.helpers import run_cli  # pylint: disable=import-outside-toplevel
  missing = targets.compiler_missing(targets.parse("tpu7x-8"))
  if missing:
    pytest.skip(missing)
  path = tmp_path / "step.hlo.txt"
  proc = run_cli("--config=configs/tiny.py", "--config.precision.matmul=fp8", "--dry_run",
                 "--dry_run_target=tpu7x-8", f"--dry_run_hlo={path}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert "target=tpu7x-8 compiler=tpu devices=8" in last and "fits=yes" in last, last
  assert "8 TPU v7x TensorCores, 94.8 GiB each" in proc.stdout
  assert hlo_dots.fp8_dots(hlo_dots.dot_operand_types(path.read_text())) == (7, 14)


@pytest.mark.parametrize("impl", ["blocked", "ragged"])
def test_the_experts_grouped_matmul_in_fp8_within_bounds(impl):
  """Rows sorted into 3 groups (one empty) times their group's weight, forward and both
  gradients in FP8, against float64 with the e4m3/e5m2 rounding bounds of every operand."""
  from jaxtrain.grouped_matmul import grouped_matmul  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(3)
  sizes = np.array([5, 0, 9])
  x = jnp.asarray(rng.normal(size=(16, 24)), jnp.float32)  # 2 rows past the groups
  w = jnp.asarray(rng.normal(size=(3, 24, 8)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, jnp.asarray(sizes), impl=impl,
                                               block_rows=8, precision="fp8"), x, w)
  dx, dw = (np.asarray(t, np.float64) for t in vjp(g))
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  group = np.repeat(np.arange(3), sizes)
  rows = len(group)
  g64[rows:] = 0  # rows in no group: their gradient is not used
  ex = _rounding_bound(x64[:rows], E4M3_UNIT, E4M3_TINY)
  ew = _rounding_bound(w64, E4M3_UNIT, E4M3_TINY)
  eg = _rounding_bound(g64[:rows], E5M2_UNIT, E5M2_TINY)
  for r in range(rows):
    k = group[r]
    want = x64[r] @ w64[k]
    bound = _product_bound(x64[r:r + 1], ex[r:r + 1], w64[k], ew[k])[0]
    assert np.all(np.abs(np.asarray(y, np.float64)[r] - want) <= bound * 1.001 + 1e-6)
    bound = _product_bound(g64[r:r + 1], eg[r:r + 1], w64[k].T, ew[k].T)[0]
    assert np.all(np.abs(dx[r] - g64[r] @ w64[k].T) <= bound * 1.001 + 1e-6)
  assert not np.asarray(y)[rows:].any() and not dx[rows:].any()
  for k in range(3):
    mine = group == k
    want = x64[:rows][mine].T @ g64[:rows][mine]
    bound = _product_bound(x64[:rows][mine].T, ex[mine].T, g64[:rows][mine], eg[mine])
    assert np.all(np.abs(dw[k] - want) <= bound * 1.001 + 1e-6), k
  assert not dw[1].any()  # the empty group


def _moe_tiny(precision, **changes):
  from tests.moe_helpers import on_short_rows  # pylint: disable=import-outside-toplevel
  from tests.helpers import REPO  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  config = on_short_rows(os.path.join(REPO, "configs", "moe_tiny.py"))
  config.precision.matmul = precision
  for key, value in changes.items():
    group, name = key.split(".")
    config[group][name] = value
  return config


@pytest.mark.parametrize("changes", [{"moe.grouped_matmul": "blocked"},
                                     {"moe.grouped_matmul": "ragged"},
                                     {"moe.capacity_factor": 1.25}])
def test_an_moe_model_trains_in_fp8_like_the_default(changes):
  base = train_curves(_moe_tiny("none", **changes), {}, steps=3)
  low = train_curves(_moe_tiny("fp8", **changes), {}, steps=3)
  np.testing.assert_allclose(low["loss"], base["loss"], rtol=2e-2)
  assert np.isfinite(low["grad_norm"]).all()


def test_the_experts_batched_matmul_in_fp8_within_bounds():
  """Capacity mode's [G, C, D] buffers times the stacked experts: forward and both gradients in
  FP8 (one scale per tensor), against float64 with every operand's rounding bound."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(3, 8, 24)) * np.exp(rng.normal(size=(3, 8, 24))), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 24, 16)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32)
  y, vjp = jax.vjp(lambda a, b: fp8.batched_matmul(a, b, jnp.float32), x, w)
  dx, dw = (np.asarray(t, np.float64) for t in vjp(g))
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  ex = _rounding_bound(x64, E4M3_UNIT, E4M3_TINY)
  ew = _rounding_bound(w64, E4M3_UNIT, E4M3_TINY)
  eg = _rounding_bound(g64, E5M2_UNIT, E5M2_TINY)
  for k in range(3):
    checks = [(np.asarray(y, np.float64)[k], x64[k], ex[k], w64[k], ew[k]),
              (dx[k], g64[k], eg[k], w64[k].T, ew[k].T),
              (dw[k], x64[k].T, ex[k].T, g64[k], eg[k])]
    for got, a, ea, b, eb in checks:
      assert np.all(np.abs(got - a @ b) <= _product_bound(a, ea, b, eb) * 1.001 + 1e-6), k
      assert np.linalg.norm(got - a @ b) > 0  # FP8, not the float32 product


# --- MXFP8 (jaxtrain/mxfp8.py) ----------------------------------------------------------------


def _block_bound(a, axis):
  """Per-element rounding bound of MXFP8 along `axis`: e4m3's relative unit, and half the
  subnormal spacing relative to the element's own block scale (the block's power of two)."""
  from jaxtrain import mxfp8  # pylint: disable=import-outside-toplevel
  a = np.asarray(a, np.float64)
  moved = np.moveaxis(a, axis, -1)
  blocks = moved.reshape(*moved.shape[:-1], -1, mxfp8.BLOCK)
  amax = np.abs(blocks).max(axis=-1, keepdims=True)
  scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-300) / 448.0)), 1.0)
  bound = np.maximum(E4M3_UNIT * np.abs(blocks), 2.0 ** -10 * scale * np.ones_like(blocks))
  return np.moveaxis(bound.reshape(moved.shape), -1, axis)


def test_mxfp8_blocks_scale_by_powers_of_two_and_stay_within_e4m3():
  from jaxtrain import mxfp8  # pylint: disable=import-outside-toplevel
  x = jnp.asarray(np.concatenate([np.full((2, 32), 1e-3), np.linspace(-900, 900, 64).reshape(2, 32),
                                  np.zeros((2, 32))], axis=1), jnp.float32)
  q, s = mxfp8.quantize(x, axis=1)
  assert q.shape == (2, 96) and s.shape == (2, 3) and s.dtype == mxfp8.E8M0
  scales = np.asarray(s.astype(jnp.float32))
  np.testing.assert_array_equal(np.log2(scales), np.round(np.log2(scales)))  # powers of two
  assert scales[0, 2] == 1.0 and not np.asarray(q[:, 64:].astype(jnp.float32)).any()
  assert np.abs(np.asarray(q.astype(jnp.float32))).max() <= 448
  assert scales[0, 1] == 4.0  # 900 / 4 = 225 <= 448 < 900 / 2
  with pytest.raises(ValueError, match="not a multiple of 32"):
    mxfp8.quantize(jnp.ones((2, 40)), axis=1)


def test_mxfp8_matmul_and_gradients_within_block_bounds():
  from jaxtrain import mxfp8  # pylint: disable=import-outside-toplevel
  x, w = _operands(4, n=64, i=96, o=64)
  g = jnp.asarray(np.random.default_rng(5).normal(size=(64, 64)), jnp.float32)
  y, vjp = jax.vjp(lambda a, b: mxfp8.matmul(a, b, jnp.float32), x, w)
  dx, dw = (np.asarray(t, np.float64) for t in vjp(g))
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  checks = [(np.asarray(y, np.float64), x64, _block_bound(x64, 1), w64, _block_bound(w64, 0)),
            (dx, g64, _block_bound(g64, 1), w64.T, _block_bound(w64, 1).T),
            (dw, x64.T, _block_bound(x64, 0).T, g64, _block_bound(g64, 0))]
  for got, a, ea, b, eb in checks:
    assert np.all(np.abs(got - a @ b) <= _product_bound(a, ea, b, eb) * 1.001 + 1e-5)
    assert np.linalg.norm(got - a @ b) / np.linalg.norm(a @ b) < 0.05


def test_mxfp8_training_follows_the_default_run():
  config = _small("mxfp8", d_model=64, mlp_dim=128, num_heads=4, head_dim=16, num_kv_heads=2)
  base = _small("none", d_model=64, mlp_dim=128, num_heads=4, head_dim=16, num_kv_heads=2)
  np.testing.assert_allclose(train_curves(config, {}, steps=4)["loss"],
                             train_curves(base, {}, steps=4)["loss"], rtol=1e-2)


def test_mxfp8_over_a_mesh_computes_what_one_device_computes():
  """The block-scaled matmul partitioned over a mesh (jaxtrain/mxfp8.py `_partition`): weights
  gathered along fsdp, contractions split over `tensor` summed across it, the weight gradient
  summed over the token axes. Every 32-block stays whole on one device, so each device quantizes
  exactly the blocks one device would: only the order of the sums differs."""
  from jaxtrain import mxfp8  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  x, w = _operands(6, n=128, i=128, o=64)
  loss = jax.jit(jax.value_and_grad(
      lambda a, b: jnp.sum(mxfp8.matmul(a, b, jnp.float32) ** 2), argnums=(0, 1)))
  want = jax.tree.leaves(loss(x, w))
  mesh = mesh_of({"data": 2, "fsdp": 2, "tensor": 2})
  for x_spec, w_spec in [(P(("data", "fsdp"), None), P("fsdp", "tensor")),  # column-parallel
                         (P(("data", "fsdp"), "tensor"), P("tensor", "fsdp"))]:  # row-parallel
    got = jax.tree.leaves(loss(jax.device_put(x, NamedSharding(mesh, x_spec)),
                               jax.device_put(w, NamedSharding(mesh, w_spec))))
    for g, r in zip(got, want):
      assert float(jnp.abs(g - r).max() / jnp.abs(r).max()) < 1e-6, (x_spec, w_spec)


def test_mxfp8_training_on_a_mesh_follows_one_device():
  config = _small("mxfp8", d_model=64, mlp_dim=128, num_heads=4, head_dim=16, num_kv_heads=2)
  one = train_curves(config, {}, steps=3)
  many = train_curves(config, {"data": 2, "fsdp": 2, "tensor": 2}, steps=3)
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(many[key], one[key], rtol=1e-5)


@pytest.mark.parametrize("changes,devices,words", [
    ({"mlp_dim": 120}, 1, ["model.mlp_dim=120", "multiple of 32"]),
    ({"stage": 2}, 2, ["mesh.stage=2", "pipeline stages", "precision.matmul='fp8'"]),
])
def test_mxfp8_settings_it_cannot_run_are_one_line_errors(changes, devices, words):
  from tests.helpers import assert_one_line_config_error  # pylint: disable=import-outside-toplevel
  config = _small("mxfp8", num_heads=4, head_dim=16, num_kv_heads=2,
                  **{k: v for k, v in changes.items() if k != "stage"})
  config.mesh.stage = changes.get("stage", 1)
  assert_one_line_config_error(config, devices, words)


def test_mxfp8_outside_blackwell_is_refused_in_one_line():
  from tests.helpers import run_cli  # pylint: disable=import-outside-toplevel
  proc = run_cli("--config=configs/tiny.py", "--config.precision.matmul=mxfp8", "--dry_run",
                 "--dry_run_target=h100x1")
  assert proc.returncode == 2 and "has no block-scaled (MX) FP8 matmuls" in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1
  assert "targets that have them: b200" in proc.stderr


@pytest.mark.slow(seconds=20)
def test_llama8b_mxfp8_step_for_b200x8_multiplies_every_projection_block_scaled(tmp_path):
  """configs/llama8b.py with precision.matmul=mxfp8, compiled by XLA's GPU compiler for 8 B200s
  (fsdp=8): it fits, and the scanned layer's 7 projections are cuDNN block-scaled GEMMs three
  times each (the forward and the two gradients), none of them recomputed (their outputs are
  saved by name); only the head's 3 matmuls remain plain dots."""
  from jaxtrain.dryrun import hlo_dots, targets  # pylint: disable=import-outside-toplevel
  from tests.helpers import run_cli  # pylint: disable=import-outside-toplevel
  missing = targets.compiler_missing(targets.parse("b200x8"))
  if missing:
    pytest.skip(missing)
  path = tmp_path / "step.hlo.txt"
  proc = run_cli("--config=configs/llama8b.py", "--config.precision.matmul=mxfp8", "--dry_run",
                 "--dry_run_target=b200x8", f"--dry_run_hlo={path}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  assert "target=b200x8 compiler=gpu devices=8" in last and "fits=yes" in last, last
  hlo = path.read_text()
  assert hlo_dots.block_scaled_dots(hlo) == 21
  assert sum(hlo_dots.dot_operand_types(hlo).values()) == 3
  assert "matmuls       mxfp8: 21 block-scaled matmuls" in proc.stdout


@pytest.mark.parametrize("vocab_axis", [1, 0])
def test_the_fp8_head_loss_and_gradients_stay_close_to_float32(vocab_axis):
  """precision.fp8_head: the chunked loss's head matmuls in FP8 (untied head [D, V] and tied
  table [V, D]): loss within 1%, gradients within 10% (relative norm) of the float32 ones,
  all finite."""
  from jaxtrain.cross_entropy import cross_entropy_sum  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(2, 32, 64)), jnp.float32)
  w = jnp.asarray(0.3 * rng.normal(size=(64, 128) if vocab_axis else (128, 64)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 128, (2, 32)), jnp.int32)
  mask = jnp.ones((2, 32), jnp.float32)

  def loss(x, w, in_fp8):
    return cross_entropy_sum(x, w, targets, mask, 16, False, vocab_axis, in_fp8)
  (want, want_grads), (got, got_grads) = (jax.value_and_grad(loss, argnums=(0, 1))(x, w, f)
                                          for f in (False, True))
  np.testing.assert_allclose(got, want, rtol=1e-2)
  for g, r in zip(got_grads, want_grads):
    assert np.isfinite(g).all()
    assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 0.1


def test_the_fp8_head_adds_its_three_fp8_dots_and_needs_fp8():
  config = _small("fp8", scan_layers=False, remat_policy="none")
  config.precision.fp8_head = True
  layers = config.model.num_layers
  assert _lowered_fp8_dots(config) == (7 * layers + 1, 14 * layers + 2)
  from tests.helpers import assert_one_line_config_error  # pylint: disable=import-outside-toplevel
  plain = _small("none")
  plain.precision.fp8_head = True
  assert_one_line_config_error(plain, 1, ["precision.fp8_head=True", "precision.matmul='fp8'"])
