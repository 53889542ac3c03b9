"""Rotary position embeddings (jaxtrain/models/rope.py): Llama 3's, linear and YaRN frequency
scaling against their references, the run config's scaling group, and the rotation's properties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.rope import apply_rope, rope_attention_factor, rope_inv_freq
from tests.helpers import assert_one_line_config_error

LLAMA3_SCALING = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


def _llama31_inv_freq(head_dim, theta, factor, low_freq_factor, high_freq_factor,
                      original_max_position_embeddings):
  """Straight from the Llama 3.1 reference (`apply_scaling`), one frequency at a time."""
  freqs = [1.0 / (theta ** (i / head_dim)) for i in range(0, head_dim, 2)]
  low_freq_wavelen = original_max_position_embeddings / low_freq_factor
  high_freq_wavelen = original_max_position_embeddings / high_freq_factor
  new_freqs, kinds = [], []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      new_freqs.append(freq)
      kinds.append("keep")
    elif wavelen > low_freq_wavelen:
      new_freqs.append(freq / factor)
      kinds.append("scale")
    else:
      smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
                / (high_freq_factor - low_freq_factor))
      new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
      kinds.append("smooth")
  return np.array(new_freqs), kinds


def test_rope_inv_freq_llama3_scaling():
  got = rope_inv_freq(128, 500000.0, LLAMA3_SCALING)
  want, kinds = _llama31_inv_freq(128, 500000.0, **{k: v for k, v in LLAMA3_SCALING.items()
                                                      if k != "type"})
  assert set(kinds) == {"keep", "scale", "smooth"}  # all three regimes are exercised
  assert got.shape == (64,) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_rope_inv_freq_unscaled():
  got = rope_inv_freq(16, 10000.0, None)
  want = [1.0 / 10000.0 ** (2 * i / 16) for i in range(8)]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_rope_inv_freq_linear_scaling_divides_every_frequency():
  plain = rope_inv_freq(16, 1e6, None)
  np.testing.assert_allclose(rope_inv_freq(16, 1e6, {"type": "linear", "factor": 8.0}),
                             plain / 8, rtol=1e-6)


def test_rope_scaling_from_run_config():
  """The run config's rope_scaling group becomes hashable (key, value) pairs with its type."""
  config = config_lib.default_config()
  assert ModelConfig.from_config(config).arch.rope_scaling is None
  config.model.rope_scaling.type = "linear"
  assert ModelConfig.from_config(config).arch.rope_scaling == (("type", "linear"),
                                                               ("factor", 8.0))
  config.model.rope_scaling.type = "llama3"
  scaling = ModelConfig.from_config(config).arch.rope_scaling
  hash(scaling)
  assert dict(scaling) == LLAMA3_SCALING
  np.testing.assert_array_equal(rope_inv_freq(128, 500000.0, dict(scaling)),
                                rope_inv_freq(128, 500000.0, LLAMA3_SCALING))


def _rope_reference(x, positions, inv_freq):
  """Hugging Face `rotate_half` form in float64: x * cos + rotate_half(x) * sin."""
  x = np.asarray(x, np.float64)
  angles = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
  cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, :, None]
  sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, :, None]
  half = x.shape[-1] // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_apply_rope_matches_reference_and_preserves_norm(scaling):
  inv_freq = rope_inv_freq(32, 500000.0, scaling)
  x = jax.random.normal(jax.random.key(0), (2, 12, 3, 32), jnp.float32)
  positions = np.stack([np.arange(12), np.arange(100, 112)]).astype(np.int32)
  out = np.asarray(apply_rope(x, positions, inv_freq))
  assert out.shape == x.shape and out.dtype == np.float32
  np.testing.assert_allclose(out, _rope_reference(x, positions, inv_freq), atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(np.asarray(x), axis=-1),
                             rtol=1e-5)
  # Position 0 is the identity.
  np.testing.assert_allclose(out[0, 0], np.asarray(x)[0, 0], atol=1e-7)


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_apply_rope_is_relative(scaling):
  """q·k after rotation depends only on the position difference."""
  e = 64
  inv_freq = rope_inv_freq(e, 10000.0, scaling)
  kq, kk = jax.random.split(jax.random.key(1))
  q = jax.random.normal(kq, (1, 1, 1, e), jnp.float32)
  k = jax.random.normal(kk, (1, 1, 1, e), jnp.float32)

  @jax.jit
  def _score(m, n):
    rq = apply_rope(q, jnp.reshape(m, (1, 1)), inv_freq)
    rk = apply_rope(k, jnp.reshape(n, (1, 1)), inv_freq)
    return jnp.sum(rq * rk)

  def score(m, n):
    return float(_score(jnp.int32(m), jnp.int32(n)))

  for diff in (3, -5):
    base = score(diff, 0) if diff >= 0 else score(0, -diff)
    for offset in (7, 250):
      m, n = (offset + diff, offset) if diff >= 0 else (offset, offset - diff)
      assert score(m, n) == pytest.approx(base, rel=1e-5, abs=1e-5), (diff, offset)
  # Not trivially constant: a different difference gives a different score.
  assert abs(score(3, 0) - score(4, 0)) > 1e-2


# DeepSeek-V3's published YaRN: 4096 -> 163840 positions, its qk_rope_head_dim of 64.
YARN_SCALING = dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def _yarn_reference(head_dim, theta, factor, original_max_position_embeddings, beta_fast,
                    beta_slow):
  """YaRN's "NTK-by-parts" frequencies from the paper's definitions, one dim at a time: dim i
  turns r_i = L / wavelength_i times over the original length L; dims with r above beta_fast
  keep their frequency, below beta_slow are divided by the factor, between them the two are
  blended linearly in the dim index, between the dims where r crosses the betas (rounded
  outward)."""
  freqs = [theta ** (-i / head_dim) for i in range(0, head_dim, 2)]
  length = original_max_position_embeddings

  def crossing(turns):  # the fractional index d/2 whose rotation count over L is `turns`
    return head_dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))

  low, high = max(math.floor(crossing(beta_fast)), 0), min(math.ceil(crossing(beta_slow)),
                                                            head_dim - 1)
  out, kinds = [], []
  for i, f in enumerate(freqs):
    blend = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep, 1: interpolate
    out.append(f * (1 - blend) + f / factor * blend)
    kinds.append("keep" if blend == 0 else "interpolate" if blend == 1 else "ramp")
  return np.array(out), kinds


def test_rope_inv_freq_yarn_against_its_definition():
  got = rope_inv_freq(64, 10000.0, YARN_SCALING)
  want, kinds = _yarn_reference(64, 10000.0, 40.0, 4096, 32.0, 1.0)
  assert set(kinds) == {"keep", "ramp", "interpolate"}
  np.testing.assert_allclose(got, want, rtol=1e-6)
  plain = rope_inv_freq(64, 10000.0, None)
  assert got[0] == plain[0] and got[-1] == pytest.approx(plain[-1] / 40.0, rel=1e-6)


@pytest.mark.parametrize("mscale,mscale_all_dim,want", [
    (1.0, 1.0, 1.0),  # DeepSeek-V3: cancel here, the softmax scale carries mscale_all_dim
    (0.0, 0.0, 0.1 * math.log(40.0) + 1.0),  # plain YaRN: sqrt(1/t) = 0.1 ln(s) + 1
    (1.0, 0.707, (0.1 * math.log(40.0) + 1.0) / (0.0707 * math.log(40.0) + 1.0)),
])
def test_yarn_attention_factor(mscale, mscale_all_dim, want):
  scaling = dict(YARN_SCALING, mscale=mscale, mscale_all_dim=mscale_all_dim)
  assert rope_attention_factor(scaling) == pytest.approx(want, rel=1e-12)
  assert rope_attention_factor(LLAMA3_SCALING) == rope_attention_factor(None) == 1.0
  # Applied to the rotated vectors: their norms grow by the factor.
  x = jax.random.normal(jax.random.key(2), (1, 4, 2, 64), jnp.float32)
  out = apply_rope(x, jnp.arange(4)[None], rope_inv_freq(64, 1e4, scaling), want)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1),
                             want * np.linalg.norm(np.asarray(x), axis=-1), rtol=1e-5)


def test_yarn_from_run_config_and_its_errors():
  config = config_lib.default_config()
  config.model.rope_scaling.update(YARN_SCALING)
  scaling = ModelConfig.from_config(config).arch.rope_scaling
  assert dict(scaling) == YARN_SCALING
  for key, value, words in (("beta_slow", 40.0, ["beta_slow=40.0", "beta_fast >= beta_slow > 0"]),
                            ("factor", 0.0, ["factor=0.0", "yarn needs both positive"]),
                            ("mscale", -1.0, ["mscale=-1.0", "must be >= 0"])):
    bad = config_lib.default_config()
    bad.model.rope_scaling.update(YARN_SCALING)
    bad.model.rope_scaling[key] = value
    assert_one_line_config_error(bad, 1, ["model.rope_scaling.", *words])
