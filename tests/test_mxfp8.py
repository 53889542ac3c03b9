"""MXFP8 matmuls (jaxtrain/ops/mxfp8.py): power-of-two block scales within e4m3's bounds, gradients,
meshes, a model's first-step gradient, the refusals, and the B200 deviceless compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fp8_helpers import E4M3_UNIT, MXFP8_DIMS, operands, product_bound, small_in
from tests.helpers import mesh_of, train_curves


def _block_bound(a, axis):
  """Per-element rounding bound of MXFP8 along `axis`: e4m3's relative unit, and half the
  subnormal spacing relative to the element's own block scale (the block's power of two)."""
  from jaxtrain.ops import mxfp8  # pylint: disable=import-outside-toplevel
  a = np.asarray(a, np.float64)
  moved = np.moveaxis(a, axis, -1)
  blocks = moved.reshape(*moved.shape[:-1], -1, mxfp8.BLOCK)
  amax = np.abs(blocks).max(axis=-1, keepdims=True)
  scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-300) / 448.0)), 1.0)
  bound = np.maximum(E4M3_UNIT * np.abs(blocks), 2.0 ** -10 * scale * np.ones_like(blocks))
  return np.moveaxis(bound.reshape(moved.shape), -1, axis)


def test_mxfp8_blocks_scale_by_powers_of_two_and_stay_within_e4m3():
  from jaxtrain.ops import mxfp8  # pylint: disable=import-outside-toplevel
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
  from jaxtrain.ops import mxfp8  # pylint: disable=import-outside-toplevel
  x, w = operands(4, n=64, i=96, o=64)
  g = jnp.asarray(np.random.default_rng(5).normal(size=(64, 64)), jnp.float32)
  y, vjp = jax.vjp(lambda a, b: mxfp8.matmul(a, b, jnp.float32), x, w)
  dx, dw = (np.asarray(t, np.float64) for t in vjp(g))
  x64, w64, g64 = (np.asarray(t, np.float64) for t in (x, w, g))
  checks = [(np.asarray(y, np.float64), x64, _block_bound(x64, 1), w64, _block_bound(w64, 0)),
            (dx, g64, _block_bound(g64, 1), w64.T, _block_bound(w64, 1).T),
            (dw, x64.T, _block_bound(x64, 0).T, g64, _block_bound(g64, 0))]
  for got, a, ea, b, eb in checks:
    assert np.all(np.abs(got - a @ b) <= product_bound(a, ea, b, eb) * 1.001 + 1e-5)
    assert np.linalg.norm(got - a @ b) / np.linalg.norm(a @ b) < 0.05


def test_mxfp8_over_a_mesh_computes_what_one_device_computes():
  """The block-scaled matmul partitioned over a mesh (jaxtrain/ops/mxfp8.py `_partition`): weights
  gathered along fsdp, contractions split over `tensor` summed across it, the weight gradient
  summed over the token axes. Every 32-block stays whole on one device, so each device quantizes
  exactly the blocks one device would: only the order of the sums differs."""
  from jaxtrain.ops import mxfp8  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  x, w = operands(6, n=128, i=128, o=64)
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
  config = small_in("mxfp8", **MXFP8_DIMS)
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
  config = small_in("mxfp8", num_heads=4, head_dim=16, num_kv_heads=2,
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
  (fsdp=8): it fits, and the scanned layer's 7 projections are block-scaled products three
  times each (the forward and the two gradients), none of them recomputed (their outputs are
  saved by name); only the head's 3 matmuls remain plain dots. The products are cuDNN
  block-scaled GEMMs where this jax's compiler builds them without a GPU (jax 0.10), and
  dequantized bf16 dots otherwise (jax 0.12: jaxtrain/compat.py), which the row then says."""
  from jaxtrain import compat  # pylint: disable=import-outside-toplevel
  from jaxtrain.dryrun import hlo_dots
  from jaxtrain import hardware as targets  # pylint: disable=import-outside-toplevel
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
  assert hlo_dots.block_scaled_matmuls(hlo) == 21
  row = "matmuls       mxfp8: 21 block-scaled matmuls (e4m3 with an e8m0 scale per 32), 3 other dots"
  assert row in proc.stdout
  if compat.deviceless_block_scaled_gemm():
    assert hlo_dots.block_scaled_dots(hlo) == 21
    assert sum(hlo_dots.dot_operand_types(hlo).values()) == 3
    assert "dequantized" not in proc.stdout
  else:
    assert hlo_dots.block_scaled_dots(hlo) == 0
    assert sum(hlo_dots.dot_operand_types(hlo).values()) == 21 + 3
    assert ("21 of the block-scaled ones compiled as dequantized bf16 dots, 0 as block-scaled "
            "GEMMs (this jax's XLA:GPU plans cuDNN's block-scaled GEMM only with a GPU driver"
            in proc.stdout)
