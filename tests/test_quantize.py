"""QLoRA's weight quantization on its own (jaxtrain.ops.quantize): NF4 levels, round-trip
error bounds, packing, and the errors for shapes it cannot quantize."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.ops import quantize as quant

_quantize = jax.jit(quant.quantize, static_argnums=(1, 2, 3))
_dequantize = jax.jit(quant.dequantize, static_argnums=(2, 3, 4))

def test_nf4_levels_are_normal_quantiles():
  # QLoRA: 2^(k-1) quantiles for the positive half and 2^(k-1) - 1 for the negative half of
  # N(0, 1), at probabilities spaced evenly up to `offset`, normalized to [-1, 1], plus 0.
  offset = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))
  pos = jax.scipy.special.ndtri(jnp.linspace(offset, 0.5, 9)[:-1])
  neg = -jax.scipy.special.ndtri(jnp.linspace(offset, 0.5, 8)[:-1])
  levels = np.sort(np.concatenate([np.asarray(pos), [0.0], np.asarray(neg)]))
  np.testing.assert_allclose(levels / levels.max(), quant.NF4_LEVELS, atol=2e-6)


@pytest.mark.parametrize("scheme, bound", [("int8", 1e-2), ("int4", 0.12), ("nf4", 0.1)])
def test_round_trip_error_on_normal_weights(scheme, bound):
  w = jax.random.normal(jax.random.key(0), (512, 8, 16), jnp.float32)
  codes, scales = _quantize(w, scheme, 64, 1)
  back = _dequantize(codes, scales, scheme, w.shape, jnp.float32)
  rel = float(jnp.sqrt(jnp.mean((back - w) ** 2) / jnp.mean(w ** 2)))
  print(f"\n{scheme} group 64: relative RMS error {rel:.4f}")
  assert rel < bound
  packed = quant.BITS[scheme] == 4
  assert codes.shape == ((256 if packed else 512), 8, 16) and scales.shape == (8, 8, 16)
  assert codes.dtype == (jnp.uint8 if packed else jnp.int8) and scales.dtype == jnp.float32


def _grid_weight(scheme, shape, group_size, seed=0):
  """A weight already on the scheme's grid: power-of-two scales, each group reaching absmax."""
  rng = np.random.default_rng(seed)
  in_size = shape[0]
  top = {"int8": 127, "int4": 7}.get(scheme)
  if scheme == "nf4":
    values = quant.NF4_LEVELS[rng.integers(0, 16, shape)]
  else:
    values = rng.integers(-top, top + 1, shape).astype(np.float32)
  values = values.reshape(in_size // group_size, group_size, *shape[1:])
  values[:, 0] = 1.0 if scheme == "nf4" else top
  scales = 2.0 ** rng.integers(-8, 2, (in_size // group_size, 1, *shape[1:]))
  return jnp.asarray((values * scales).reshape(shape), jnp.float32)


@pytest.mark.parametrize("scheme", quant.SCHEMES)
@pytest.mark.parametrize("group_size", [2, 16, 64])
def test_round_trip_is_exact_on_the_grid(scheme, group_size):
  w = _grid_weight(scheme, (64, 6), group_size)
  codes, scales = _quantize(w, scheme, group_size, 1)
  assert scales.shape == (64 // group_size, 6)
  np.testing.assert_array_equal(_dequantize(codes, scales, scheme, w.shape, jnp.float32), w)


def test_several_input_dims_and_zero_groups():
  # The o projection's [H, E, D] weight: the input is H*E, groups may span heads.
  w = jax.random.normal(jax.random.key(1), (4, 8, 6)).at[:2].set(0.0)  # first 16 inputs zero
  codes, scales = _quantize(w, "nf4", 16, 2)
  assert codes.shape == (16, 6) and scales.shape == (2, 6)
  back = _dequantize(codes, scales, "nf4", w.shape, jnp.bfloat16)
  assert back.shape == w.shape and back.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(back[:2], np.float32), 0.0)
  assert np.all(np.asarray(scales[0]) == 0) and np.all(np.isfinite(np.asarray(back, np.float32)))


def test_packing_round_trip():
  codes = jnp.asarray(np.random.default_rng(0).integers(0, 16, (10, 3, 2)), jnp.uint8)
  packed = quant.pack_nibbles(codes)
  assert packed.shape == (5, 3, 2) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(quant.unpack_nibbles(packed), codes)
  assert int(packed[0, 0, 0]) == int(codes[0, 0, 0]) | int(codes[1, 0, 0]) << 4
  with pytest.raises(ValueError, match="odd size 3"):
    quant.pack_nibbles(codes[:3])


@pytest.mark.parametrize("args, match", [
    (((48, 4), "nf4", 32), r"48 input elements per output, not a multiple of "
                            r"quant_group_size=32; use a group size dividing 48 \(e.g. 16\)"),
    (((64, 4), "int4", 5), "positive even number"),
    (((64, 4), "int8", 0), "positive number"),
    (((64, 4), "fp4", 16), "scheme 'fp4' unknown"),
    (((64,), "int8", 16), "leaves no output dim"),
])
def test_bad_shapes_give_clear_errors(args, match):
  shape, scheme, group = args
  with pytest.raises(ValueError, match=match):
    quant.quantize(jnp.ones(shape), scheme, group)
