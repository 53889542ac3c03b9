"""FP8 matmuls (jaxtrain/ops/fp8.py): error within the formats' rounding bounds, zeros, very large
values, scales, gradients, experts' stacks with a scale per expert; a model's first-step
gradient under `precision.matmul=fp8` and `mxfp8` against the compute dtype's."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.ops import fp8
from jaxtrain.train import setup as train_setup, loop as trainer
from tests.fp8_helpers import (E4M3_TINY, E4M3_UNIT, E5M2_TINY, E5M2_UNIT, MXFP8_DIMS,
                               operands, product_bound, rounding_bound, small_in)
from tests.helpers import mesh_of, packed_batch

@pytest.mark.parametrize("scale", [1.0, 1e-6, 1e20])
def test_forward_error_within_e4m3_bounds(scale):
  x, w = operands(0)
  x = x * scale
  y = np.asarray(fp8.matmul(x, w, jnp.float32), np.float64)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  bound = product_bound(x, rounding_bound(x, E4M3_UNIT, E4M3_TINY),
                         w, rounding_bound(w, E4M3_UNIT, E4M3_TINY))
  # Plus float32 accumulation, far below the FP8 rounding.
  assert np.all(np.abs(y - want) <= bound * 1.001 + 1e-5 * np.abs(want)), np.max(
      np.abs(y - want) / bound)
  assert np.isfinite(y).all()
  # Typical error: a few percent of the result's scale, not the worst case.
  assert np.linalg.norm(y - want) / np.linalg.norm(want) < 0.05


def test_gradients_within_e5m2_and_e4m3_bounds():
  x, w = operands(1)
  g = jnp.asarray(np.random.default_rng(2).normal(size=(x.shape[0], w.shape[1])), jnp.float32)
  _, vjp = jax.vjp(lambda a, b: fp8.matmul(a, b, jnp.float32), x, w)
  dx, dw = (np.asarray(t, np.float64) for t in vjp(g))
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  ex, ew = (rounding_bound(t, E4M3_UNIT, E4M3_TINY) for t in (x64, w64))
  eg = rounding_bound(g64, E5M2_UNIT, E5M2_TINY)
  assert np.all(np.abs(dx - g64 @ w64.T) <= product_bound(g64, eg, w64.T, ew.T) * 1.001)
  assert np.all(np.abs(dw - x64.T @ g64) <= product_bound(x64.T, ex.T, g64, eg) * 1.001)
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


def test_every_projection_runs_in_fp8_forward_and_backward():
  """Unrolled layers without remat: each layer's 7 projections (q, k, v, o, gate, up, down) are
  3 FP8 dots each (the forward, and the backward's two), e4m3 by e4m3 forward and e5m2 by e4m3
  backward; the output head stays in the compute dtype."""
  config = small_in("fp8", scan_layers=False, remat_policy="none")
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


def _first_step_grads(config) -> dict[str, np.ndarray]:
  """{param path: the gradient of `config`'s loss on the first train batch at the seed-0 init}
  in float64 (params of every matmul precision are the same arrays: precision is no param)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.sharding import init_params  # pylint: disable=import-outside-toplevel
  from jaxtrain.train.step import make_grad_fn  # pylint: disable=import-outside-toplevel
  mesh = mesh_of({})
  graphdef, params = init_params(ModelConfig.from_config(config), mesh, seed=0)
  grad_fn = jax.jit(make_grad_fn(graphdef, loss_chunk_size=config.train.loss_chunk_size))
  batch = packed_batch(config.train.global_batch_size, config.train.seq_len,
                       config.model.vocab_size, docs_per_row=3)
  with jax.set_mesh(mesh):
    _, _, grads = grad_fn(params, trainer.to_global_batch(batch, mesh))
  return {jax.tree_util.keystr(path): np.asarray(g, np.float64).ravel()
          for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads))}


# Measured (first step, every case below): each param's gradient norm within 1.5% of the
# compute dtype's and its cosine with it 0.985 or more; the whole gradient's norm within 0.4%,
# cosine 0.996 or more. Loss curves cannot tell a broken backward (a few steps on random tokens
# over 128 tokens move the loss by 0.02%, and uniform logits are 0.2% from it): these bounds
# can. A zeroed FP8 backward gives the projections zero gradients, a doubled one a whole norm
# 3.6 times (the factor compounds through the layers); zeroing only the experts' backward keeps
# the whole gradient at ratio 0.97, cosine 0.98, hence the check per param.
GRAD_NORM_RATIO_BAND = 0.05
GRAD_MIN_COSINE = 0.95


def _assert_gradients_follow(low: dict, base: dict):
  """Every param's gradient, and the whole, within the bands above of the reference's."""
  def ratio_and_cosine(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if nb == 0:  # a param the loss does not reach: nothing to compare but zero
      return (1.0, 1.0) if na == 0 else (np.inf, 0.0)
    return na / nb, (a @ b) / (na * nb) if na > 0 else 0.0
  wholes = (np.concatenate(list(t.values())) for t in (low, base))
  for name, (ratio, cosine) in [("the whole gradient", ratio_and_cosine(*wholes)),
                                *((k, ratio_and_cosine(low[k], base[k])) for k in base)]:
    assert np.isfinite(ratio) and abs(ratio - 1) < GRAD_NORM_RATIO_BAND, (
        f"{name}: gradient norm {ratio:.4f} x the reference's")
    assert cosine > GRAD_MIN_COSINE, f"{name}: gradient cosine {cosine:.4f} with the reference's"


def test_an_unknown_matmul_precision_is_a_one_line_error():
  from tests.helpers import assert_one_line_config_error  # pylint: disable=import-outside-toplevel
  assert_one_line_config_error(small_in("fp4"), 1, ["precision.matmul='fp4'", "none, fp8"])


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
  from jaxtrain.dryrun import hlo_dots
  from jaxtrain.train import hlo_flops  # pylint: disable=import-outside-toplevel
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
  from jaxtrain.dryrun import hlo_dots
  from jaxtrain import hardware as targets  # pylint: disable=import-outside-toplevel
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
  from jaxtrain import hardware as targets  # pylint: disable=import-outside-toplevel
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
  from jaxtrain.dryrun import hlo_dots
  from jaxtrain import hardware as targets  # pylint: disable=import-outside-toplevel
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


def _heavy(rng, *shape):
  """Magnitudes over several orders, as activations have."""
  return rng.normal(size=shape) * np.exp(rng.normal(size=shape))


# One expert 1000 times the others (its weight, its rows, their output gradient): with one
# scale over the stack the others' values drop 10 binades into e4m3's 17.8 and their small
# elements into its subnormals, which breaks their own bounds (at 100 times e4m3's range still
# absorbs it: the worst element is 0.69 of its bound). Per-expert scales leave them as they are.
LARGE = 1000.0


def _assert_within_own_bounds(got, a, ea, b, eb, what):
  """|got - a @ b| within the bound for operands off by ea and eb, and not exact (FP8 ran)."""
  err = np.abs(got - a @ b)
  bound = product_bound(a, ea, b, eb)
  assert np.all(err <= bound * 1.001), f"{what}: error {np.max(err / bound):.3g} x its bound"
  assert np.linalg.norm(err) > 0, what  # FP8, not the float32 product


def _grouped_fp8(impl, sizes, x, w, g):
  from jaxtrain.ops.grouped_matmul import grouped_matmul  # pylint: disable=import-outside-toplevel
  y, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, jnp.asarray(sizes), impl=impl,
                                               block_rows=8, precision="fp8"),
                   *(jnp.asarray(t, jnp.float32) for t in (x, w)))
  return tuple(np.asarray(t, np.float64) for t in (y, *vjp(jnp.asarray(g, jnp.float32))))


@pytest.mark.parametrize("large", [1.0, LARGE])
@pytest.mark.parametrize("impl", ["blocked", "ragged"])
def test_the_experts_grouped_matmul_in_fp8_within_each_experts_bounds(impl, large):
  """Rows sorted into 4 groups (one empty) times their group's weight, forward and both
  gradients in FP8, against float64: each expert within the e4m3/e5m2 rounding bounds of its
  own rows, weight and output gradient (each with its own scale), also beside an expert
  `large` times the others, whose presence leaves the other experts' results exactly as they
  are."""
  rng = np.random.default_rng(3)
  sizes, big = np.array([5, 0, 9, 7]), 2
  group = np.repeat(np.arange(len(sizes)), sizes)
  rows = len(group)
  x, w, g = _heavy(rng, rows + 2, 32), _heavy(rng, len(sizes), 32, 16), _heavy(rng, rows + 2, 16)
  g[rows:] = 0  # rows in no group (2 past the groups): their gradient is not used
  x, w, g = (np.asarray(np.float32(t), np.float64) for t in (x, w, g))
  w_big, x_big, g_big = w.copy(), x.copy(), g.copy()
  w_big[big] *= large
  x_big[:rows][group == big] *= large
  g_big[:rows][group == big] *= large
  y, dx, dw = _grouped_fp8(impl, sizes, x_big, w_big, g_big)
  assert not y[rows:].any() and not dx[rows:].any() and not dw[1].any()  # and the empty group
  for k in (0, 2, 3):
    mine = group == k
    xk, gk, wk = x_big[:rows][mine], g_big[:rows][mine], w_big[k]
    ex, ew = rounding_bound(xk, E4M3_UNIT, E4M3_TINY), rounding_bound(wk, E4M3_UNIT, E4M3_TINY)
    eg = rounding_bound(gk, E5M2_UNIT, E5M2_TINY)
    _assert_within_own_bounds(y[:rows][mine], xk, ex, wk, ew, f"y of expert {k}")
    _assert_within_own_bounds(dx[:rows][mine], gk, eg, wk.T, ew.T, f"dx of expert {k}")
    _assert_within_own_bounds(dw[k], xk.T, ex.T, gk, eg, f"dw of expert {k}")
  if large != 1:
    small = group != big
    y1, dx1, dw1 = _grouped_fp8(impl, sizes, x, w, g)
    np.testing.assert_array_equal(y[:rows][small], y1[:rows][small])
    np.testing.assert_array_equal(dx[:rows][small], dx1[:rows][small])
    np.testing.assert_array_equal(dw[[0, 3]], dw1[[0, 3]])


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


# name: (config of a matmul precision, the low precision)
FIRST_STEP_CASES = {
    "fp8": (small_in, "fp8"),
    "mxfp8": (lambda precision: small_in(precision, **MXFP8_DIMS), "mxfp8"),
    "moe-blocked": (lambda precision: _moe_tiny(precision, **{"moe.grouped_matmul": "blocked"}),
                    "fp8"),
    "moe-ragged": (lambda precision: _moe_tiny(precision, **{"moe.grouped_matmul": "ragged"}),
                   "fp8"),
    "moe-capacity": (lambda precision: _moe_tiny(precision, **{"moe.capacity_factor": 1.25}),
                     "fp8"),
}


@pytest.mark.parametrize("case", list(FIRST_STEP_CASES))
def test_the_first_steps_gradient_follows_the_compute_dtypes(case):
  """The small model's first-step gradient under precision.matmul=fp8 and mxfp8, and the MoE
  model's under fp8 in each of the experts' routes, against the compute dtype's (float32 on
  CPU), param by param: norm and direction within bounds a zeroed or mis-scaled FP8 backward
  breaks."""
  make, precision = FIRST_STEP_CASES[case]
  _assert_gradients_follow(_first_step_grads(make(precision)), _first_step_grads(make("none")))


@pytest.mark.parametrize("large", [1.0, LARGE])
def test_the_experts_batched_matmul_in_fp8_within_each_experts_bounds(large):
  """Capacity mode's [G, C, D] buffers times the stacked experts: forward and both gradients in
  FP8, each expert within the rounding bounds of its own operands (a scale per expert and
  operand), also beside an expert `large` times the others."""
  def batched_fp8(x, w, g):
    y, vjp = jax.vjp(lambda a, b: fp8.batched_matmul(a, b, jnp.float32),
                     *(jnp.asarray(t, jnp.float32) for t in (x, w)))
    return tuple(np.asarray(t, np.float64) for t in (y, *vjp(jnp.asarray(g, jnp.float32))))
  rng = np.random.default_rng(4)
  plain = _heavy(rng, 3, 8, 32), _heavy(rng, 3, 32, 16), _heavy(rng, 3, 8, 16)
  x64, w64, g64 = (np.asarray(np.float32(t), np.float64) for t in plain)
  for t in (x64, w64, g64):
    t[1] *= large
  y, dx, dw = batched_fp8(x64, w64, g64)
  for k in range(3):
    ex, ew = (rounding_bound(t[k], E4M3_UNIT, E4M3_TINY) for t in (x64, w64))
    eg = rounding_bound(g64[k], E5M2_UNIT, E5M2_TINY)
    _assert_within_own_bounds(y[k], x64[k], ex, w64[k], ew, f"y of expert {k}")
    _assert_within_own_bounds(dx[k], g64[k], eg, w64[k].T, ew.T, f"dx of expert {k}")
    _assert_within_own_bounds(dw[k], x64[k].T, ex.T, g64[k], eg, f"dw of expert {k}")
  if large != 1:  # the other experts' results as without the large one
    for got, want in zip((y, dx, dw), batched_fp8(*plain)):
      np.testing.assert_array_equal(got[[0, 2]], want[[0, 2]])


@pytest.mark.parametrize("vocab_axis", [1, 0])
def test_the_fp8_head_loss_and_gradients_stay_close_to_float32(vocab_axis):
  """precision.fp8_head: the chunked loss's head matmuls in FP8 (untied head [D, V] and tied
  table [V, D]): loss within 1%, gradients within 10% (relative norm) of the float32 ones,
  all finite."""
  from jaxtrain.ops.cross_entropy import (  # pylint: disable=import-outside-toplevel
      cross_entropy_sum)
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
  config = small_in("fp8", scan_layers=False, remat_policy="none")
  config.precision.fp8_head = True
  layers = config.model.num_layers
  assert _lowered_fp8_dots(config) == (7 * layers + 1, 14 * layers + 2)
  from tests.helpers import assert_one_line_config_error  # pylint: disable=import-outside-toplevel
  plain = small_in("none")
  plain.precision.fp8_head = True
  assert_one_line_config_error(plain, 1, ["precision.fp8_head=True", "precision.matmul='fp8'"])
