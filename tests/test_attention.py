"""Tests for jaxtrain.attention: XLA attention against a naive reference, padding, dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import attention as attention_lib

B, T, E = 2, 24, 16
H = 8  # query heads; K kv heads is H // G for the group sizes below


def naive_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, causal=True, sm_scale=None):
  """Textbook attention: K/V heads repeated to H, an explicit [B, T, S] mask, -inf softmax."""
  b, t, h, e = q_BTHE.shape
  s, k = k_BSKE.shape[1], k_BSKE.shape[2]
  sm_scale = e ** -0.5 if sm_scale is None else sm_scale
  k_BSHE = jnp.repeat(k_BSKE, h // k, axis=2)
  v_BSHE = jnp.repeat(v_BSKE, h // k, axis=2)
  mask_BTS = jnp.ones((b, t, s), dtype=bool)
  if causal:  # query i sits at absolute position i + (s - t) (aligned to the last key)
    mask_BTS &= jnp.arange(s)[None, None, :] <= jnp.arange(t)[None, :, None] + (s - t)
  if segment_ids_BT is not None:
    seg_BT = jnp.asarray(segment_ids_BT)
    mask_BTS &= seg_BT[:, :, None] == seg_BT[:, None, :]
  scores_BHTS = jnp.einsum("bthe,bshe->bhts", q_BTHE, k_BSHE,
                           precision=jax.lax.Precision.HIGHEST) * sm_scale
  scores_BHTS = jnp.where(mask_BTS[:, None], scores_BHTS, -jnp.inf)
  probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1)
  return jnp.einsum("bhts,bshe->bthe", probs_BHTS, v_BSHE, precision=jax.lax.Precision.HIGHEST)


def _qkv(num_kv_heads, t=T, s=T, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, t, H, E), jnp.float32)
  k = jax.random.normal(kk, (B, s, num_kv_heads, E), jnp.float32)
  v = jax.random.normal(kv, (B, s, num_kv_heads, E), jnp.float32)
  return q, k, v


# Row 0: three packed documents then padding (0); row 1: padding in the middle, a doc after it.
SEGMENT_IDS = np.array([[1] * 7 + [2] * 9 + [3] * 4 + [0] * 4,
                        [5] * 10 + [0] * 3 + [6] * 8 + [0] * 3], dtype=np.int32)
assert SEGMENT_IDS.shape == (B, T)

_xla = jax.jit(attention_lib.xla_attention, static_argnames=("causal", "sm_scale"))
_naive = jax.jit(naive_attention, static_argnames=("causal", "sm_scale"))


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_segments", [False, True])
def test_xla_attention_matches_naive(group, causal, with_segments):
  q, k, v = _qkv(H // group)
  seg = jnp.asarray(SEGMENT_IDS) if with_segments else None
  got = _xla(q, k, v, seg, causal=causal)
  want = _naive(q, k, v, seg, causal=causal)
  assert got.shape == (B, T, H, E) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_xla_attention_custom_scale_matches_naive():
  q, k, v = _qkv(2)
  got = _xla(q, k, v, jnp.asarray(SEGMENT_IDS), causal=True, sm_scale=0.1)
  want = _naive(q, k, v, jnp.asarray(SEGMENT_IDS), causal=True, sm_scale=0.1)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_xla_attention_cross_lengths_matches_naive(causal):
  """Fewer queries than keys (T < S), no segments: causal is aligned to the last key."""
  q, k, v = _qkv(2, t=8, s=T)
  got = _xla(q, k, v, None, causal=causal)
  want = _naive(q, k, v, None, causal=causal)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_padding_rows_are_finite(causal):
  """Segment 0 (padding) rows, including a row that is all padding, never produce NaN."""
  q, k, v = _qkv(2)
  seg = np.array(SEGMENT_IDS)
  seg[1] = 0  # row 1 entirely padding
  out = _xla(q, k, v, jnp.asarray(seg), causal=causal)
  assert np.all(np.isfinite(np.asarray(out)))
  # Non-padding tokens are unaffected by the padding: they match the naive result.
  want = _naive(q, k, v, seg, causal=causal)
  real = seg != 0
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(want)[real], atol=1e-5, rtol=1e-5)


def test_padding_gradients_are_finite():
  q, k, v = _qkv(2)
  seg = np.zeros((B, T), np.int32)
  seg[0, :5] = 1

  def loss(q, k, v):
    return jnp.sum(attention_lib.xla_attention(q, k, v, jnp.asarray(seg)) ** 2)

  for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v):
    assert np.all(np.isfinite(np.asarray(g)))


def test_segments_are_isolated():
  """Changing the keys/values of one document leaves every other document's output unchanged."""
  q, k, v = _qkv(2)
  seg = jnp.asarray(SEGMENT_IDS)
  base = np.asarray(_xla(q, k, v, seg, causal=False))
  doc2 = np.asarray(SEGMENT_IDS[0] == 2)
  k2 = k.at[0, doc2].add(3.0)
  v2 = v.at[0, doc2].add(3.0)
  out = np.asarray(_xla(q, k2, v2, seg, causal=False))
  others = np.ones((B, T), bool)
  others[0, doc2] = False
  np.testing.assert_array_equal(out[others], base[others])
  assert not np.allclose(out[0, doc2], base[0, doc2])


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_match_naive(group, causal):
  q, k, v = _qkv(H // group)
  seg = jnp.asarray(SEGMENT_IDS)
  w = jax.random.normal(jax.random.key(7), (B, T, H, E), jnp.float32)

  def loss_fn(fn):
    def loss(q, k, v):
      return jnp.sum(fn(q, k, v, seg, causal=causal) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  got = loss_fn(attention_lib.xla_attention)(q, k, v)
  want = loss_fn(naive_attention)(q, k, v)
  for name, g, r in zip("qkv", got, want):
    assert np.all(np.isfinite(np.asarray(g))), name
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=f"d/d{name}")


def test_dispatcher_auto_is_xla_on_cpu():
  q, k, v = _qkv(2)
  seg = jnp.asarray(SEGMENT_IDS)
  got = attention_lib.attention(q, k, v, seg, impl="auto")
  want = attention_lib.xla_attention(q, k, v, seg)
  np.testing.assert_array_equal(got, want)


def test_resolve_impl_auto():
  assert jax.default_backend() == "cpu"
  assert attention_lib.resolve_impl("auto") == "xla"
  assert attention_lib.resolve_impl("auto", platform="cpu") == "xla"
  assert attention_lib.resolve_impl("auto", platform="tpu") == "pallas"
  assert attention_lib.resolve_impl("auto", platform="gpu") == "cudnn"
  assert attention_lib.resolve_impl("xla") == "xla"
  assert attention_lib.resolve_impl("cudnn", platform="gpu") == "cudnn"


def test_resolve_impl_cudnn_on_cpu_raises():
  with pytest.raises(ValueError, match="GPU"):
    attention_lib.resolve_impl("cudnn")
  q, k, v = _qkv(2)
  with pytest.raises(ValueError, match="GPU"):
    attention_lib.attention(q, k, v, impl="cudnn")


@pytest.mark.parametrize("impl", ["flash", "XLA", "", "splash"])
def test_resolve_impl_unknown_raises(impl):
  with pytest.raises(ValueError, match="unknown"):
    attention_lib.resolve_impl(impl)


def test_attention_mask_shapes_and_diagonal():
  mask = attention_lib.attention_mask(jnp.asarray(SEGMENT_IDS), T, T)
  assert mask.shape == (B, 1, T, T) and mask.dtype == jnp.bool_
  assert np.all(np.diagonal(np.asarray(mask)[:, 0], axis1=1, axis2=2))
  assert attention_lib.attention_mask(None, T, T).shape == (1, 1, T, T)
