"""What the FP8 and MXFP8 tests share (tests/test_fp8.py, tests/test_mxfp8.py): the formats'
rounding bounds, operands with activations' spread of magnitudes, a small config in a matmul
precision."""

import jax.numpy as jnp
import numpy as np

from tests.helpers import small_config

E4M3_UNIT = 2.0 ** -4  # e4m3: 3 mantissa bits, round to nearest
E5M2_UNIT = 2.0 ** -3  # e5m2: 2 mantissa bits
# Half the spacing of the subnormals (e4m3 2^-9, e5m2 2^-16) in units of the scale, which maps
# the tensor's largest magnitude onto the format's largest value (448, 57344): relative to that
# magnitude.
E4M3_TINY = 2.0 ** -10 / 448
E5M2_TINY = 2.0 ** -17 / 57344


def rounding_bound(v, unit, tiny):
  """Largest error of each element of v after scaling to the format and back."""
  v = np.abs(np.asarray(v, np.float64))
  return np.maximum(unit * v, tiny * v.max())


def product_bound(a, ea, b, eb):
  """Bound on |a' @ b' - a @ b| with |a' - a| <= ea, |b' - b| <= eb elementwise."""
  a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
  return a @ eb + ea @ b + ea @ eb


def operands(seed, n=48, i=96, o=40):
  rng = np.random.default_rng(seed)
  # Magnitudes over several orders, as activations have.
  x = rng.normal(size=(n, i)) * np.exp(rng.normal(size=(n, i)))
  return jnp.asarray(x, jnp.float32), jnp.asarray(rng.normal(size=(i, o)), jnp.float32)


MXFP8_DIMS = {"d_model": 64, "mlp_dim": 128, "num_heads": 4, "head_dim": 16, "num_kv_heads": 2}


def small_in(precision, **model):
  config = small_config(**model)
  config.precision.matmul = precision
  return config
