"""Tests for jaxtrain.ops.attention: XLA attention against a naive reference, padding, dispatch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.ops import attention as attention_lib
from jaxtrain.parallel.mesh import make_mesh

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


# ------------------------------------------------------------------------------ sliding window


def loop_window_mask(t, s, window, segment_ids=None):
  """[B or 1, T, S] by explicit loops: query i (at key position i + s - t) sees key j iff
  0 <= i + s - t - j < window (and, with segment ids, same segment)."""
  b = 1 if segment_ids is None else segment_ids.shape[0]
  mask = np.zeros((b, t, s), bool)
  for row in range(b):
    for i in range(t):
      for j in range(s):
        same = segment_ids is None or segment_ids[row, i] == segment_ids[row, j]
        mask[row, i, j] = 0 <= i + s - t - j < window and same
  return mask


def masked_naive(q, k, v, mask_BTS, sm_scale=None):
  """naive_attention's textbook math under an explicit boolean mask."""
  h, e = q.shape[2], q.shape[3]
  k_BSHE, v_BSHE = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
  scores = jnp.einsum("bthe,bshe->bhts", q, k_BSHE, precision=jax.lax.Precision.HIGHEST)
  scores = jnp.where(mask_BTS[:, None], scores * (sm_scale or e ** -0.5), -jnp.inf)
  return jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(scores, axis=-1), v_BSHE,
                    precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("window,group,with_segments", [
    (1, 1, True), (5, 4, True), (5, 2, False), (T, 1, False), (100, 4, True)])
def test_xla_attention_window_matches_loop_mask(window, group, with_segments):
  q, k, v = _qkv(H // group)
  seg = SEGMENT_IDS if with_segments else None
  got = jax.jit(lambda q, k, v: attention_lib.xla_attention(
      q, k, v, None if seg is None else jnp.asarray(seg), window=window))(q, k, v)
  want = masked_naive(q, k, v, jnp.asarray(loop_window_mask(T, T, window, seg)))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_xla_attention_window_cross_lengths_and_grads():
  """T < S: the window counts back from each query's bottom-right aligned position."""
  q, k, v = _qkv(2, t=8, s=T)
  mask = jnp.asarray(loop_window_mask(8, T, 5))
  loss = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2),
                                               argnums=(0, 1, 2)))
  got = loss(lambda q, k, v: attention_lib.xla_attention(q, k, v, window=5, sm_scale=0.2))(q, k, v)
  want = loss(lambda q, k, v: masked_naive(q, k, v, mask, sm_scale=0.2))(q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-5)


def test_attention_mask_window():
  mask = np.asarray(attention_lib.attention_mask(jnp.asarray(SEGMENT_IDS), T, T, window=4))
  assert mask.shape == (B, 1, T, T)
  np.testing.assert_array_equal(mask[:, 0], loop_window_mask(T, T, 4, SEGMENT_IDS))
  np.testing.assert_array_equal(attention_lib.attention_mask(None, T, T, window=None),
                                attention_lib.attention_mask(None, T, T))


@pytest.mark.parametrize("fn", [attention_lib.attention, attention_lib.xla_attention,
                                attention_lib.blockwise_attention])
@pytest.mark.parametrize("kw,match", [(dict(window=0), "positive int"),
                                      (dict(window=2.0), "positive int"),
                                      (dict(window=4, causal=False), "needs causal=True")])
def test_bad_window_raises(fn, kw, match):
  q, k, v = _qkv(2)
  with pytest.raises(ValueError, match=match):
    fn(q, k, v, **kw)


@pytest.mark.parametrize("impl,block,window", [("blockwise", 8, 5), ("blockwise", 8, 16),
                                               ("pallas", 16, 5)])
def test_fused_impls_with_window_match_xla(impl, block, window):
  """blockwise (the dry run's stand-in, in blocks of 8) and the dispatcher's pallas impl (our
  kernels, interpreted) with a window: values and gradients equal xla_attention's."""
  q, k, v = _qkv(2)
  seg = jnp.asarray(SEGMENT_IDS)
  w = jax.random.normal(jax.random.key(3), (B, T, H, E), jnp.float32)
  opts = dict(interpret=True, block_q=block, block_k=block) if impl == "pallas" else {}
  if impl == "blockwise":
    fn = lambda q, k, v: attention_lib.blockwise_attention(q, k, v, seg, window=window,
                                                            block=block)
  else:
    fn = lambda q, k, v: attention_lib.attention(q, k, v, seg, impl=impl, window=window, **opts)

  def grads(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w),
                                      argnums=(0, 1, 2)))(q, k, v)

  got = grads(fn)
  want = grads(lambda q, k, v: attention_lib.xla_attention(q, k, v, seg, window=window))
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5)


def test_dispatcher_blockwise_with_window():
  q, k, v = _qkv(2)
  got = attention_lib.attention(q, k, v, impl="blockwise", window=6)
  want = attention_lib.xla_attention(q, k, v, window=6)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# Row 0 decodes positions 18..23, row 1 positions 10..15; the cache (S=32) holds every key of
# the full sequence at its position, and garbage past it (an unwritten tail never leaks in).
_CACHE_POSITIONS = np.array([np.arange(18, 24), np.arange(10, 16)], np.int32)


def _cache_and_rows(xla_windows, sm_scale=None):
  """(q rows [B, C, H, E], cache k, v, positions) and, per window, xla_attention's same rows."""
  q, k, v = _qkv(2)
  tail = jax.random.normal(jax.random.key(9), (B, 32 - T) + k.shape[2:], jnp.float32) * 50
  cache_k, cache_v = (jnp.concatenate([x, tail], axis=1) for x in (k, v))
  pos = jnp.asarray(_CACHE_POSITIONS)
  rows = lambda x_BTHE: jnp.take_along_axis(x_BTHE, pos[:, :, None, None], axis=1)
  want = [rows(attention_lib.xla_attention(q, k, v, window=w, sm_scale=sm_scale))
          for w in xla_windows]
  return (rows(q), cache_k, cache_v, pos), want


@pytest.mark.parametrize("window,traced,xla_window", [
    (4, False, 4), (4, True, 4), (1, True, 1), (0, True, None), (0, False, None),
    (None, False, None), (100, True, None)])
def test_cached_attention_window_matches_xla_rows(window, traced, xla_window):
  """A window as a Python int or a traced int32 scalar (a jit argument); <= 0 or None: none."""
  args, (want,) = _cache_and_rows([xla_window])
  if traced:
    got = jax.jit(lambda q, k, v, pos, w: attention_lib.cached_attention(
        q, k, v, pos, jnp.float32, window=w))(*args, jnp.int32(window))
  else:
    got = jax.jit(lambda q, k, v, pos: attention_lib.cached_attention(
        q, k, v, pos, jnp.float32, window=window))(*args)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_cached_attention_per_layer_window_in_a_scan():
  """As the model decodes: a scan over layers hands each its own window (0: a global layer),
  with a custom logit scale."""
  args, want = _cache_and_rows([6, None], sm_scale=0.3)

  def layer(_, window):
    return None, attention_lib.cached_attention(*args, jnp.float32, window=window, sm_scale=0.3)

  _, got = jax.jit(lambda windows: jax.lax.scan(layer, None, windows))(jnp.array([6, 0]))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_context_parallel_refuses_window():
  q, k, v = _qkv(2)
  with jax.set_mesh(make_mesh({"context": 2}, jax.devices()[:2])):
    with pytest.raises(ValueError) as err:
      attention_lib.attention(q, k, v, window=4)
  assert str(err.value) == ("sliding-window attention (model.sliding_window) under context "
                            "parallelism (mesh.context > 1) is not supported; use mesh.context=1")


def test_cudnn_window_lowers_for_cuda():
  """Lowered for CUDA (no GPU here, like tests/test_targets.py's h100 compiles): the window
  reaches cuDNN's forward and backward fused attention as sliding_window_length W (jax's
  local_window_size (W - 1, 0)); 0 means none. cuDNN's own compile and run are untested."""
  q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, 128), jnp.int32)

  def lengths(window):
    def run(q, k, v, seg, do):
      out, vjp = jax.vjp(lambda q, k, v: attention_lib.cudnn_attention(q, k, v, seg,
                                                                        window=window), q, k, v)
      return out, vjp(do)
    text = jax.jit(run).trace(q, kv, kv, seg, q).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r"sliding_window_length\\22: (\d+)", text)

  assert lengths(16) == ["16", "16"]
  assert lengths(None) == ["0", "0"]


@pytest.mark.parametrize("padded", [False, True])
def test_values_of_their_own_head_dim_and_padded_head_dims_are_exact(monkeypatch, padded):
  """Latent attention's shapes (queries/keys of 24 dims, values of 16) through the kernels,
  which take one head dim: the values zero-padded to the queries' (and, where the kernels need
  a power of two, as our Triton kernels do for DeepSeek's 192, all three padded to 32) give
  the reference's output, the softmax scale staying the unpadded head dim's."""
  if padded:  # the GPU route's padding, run through the Pallas interpreter here
    monkeypatch.setattr(attention_lib, "kernel_head_dim",
                        lambda impl, platform, interpret, e: 32 if impl == "pallas" else e)
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(kq, (B, T, H, 24), jnp.float32)
  k = jax.random.normal(kk, (B, T, 2, 24), jnp.float32)
  v = jax.random.normal(kv, (B, T, 2, 16), jnp.float32)
  seg = jnp.asarray(np.repeat([[1, 2]], B, axis=0).repeat(T // 2, axis=1), jnp.int32)
  want = naive_attention(q, k, v, seg)
  got = attention_lib.attention(q, k, v, seg, impl="pallas", interpret=True, platform="cpu")
  assert got.shape == (B, T, H, 16)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_head_dims_cudnn_refuses_get_our_kernels_padded_to_a_power_of_two():
  assert attention_lib.kernel_head_dim("pallas", "gpu", False, 192) == 256
  assert attention_lib.kernel_head_dim("pallas", "gpu", False, 128) == 128
  assert attention_lib.kernel_head_dim("cudnn", "gpu", False, 192) == 192
  assert attention_lib.resolve_impl("auto", "gpu", head_dim=192) == "pallas"
  assert attention_lib.resolve_impl("auto", "gpu", head_dim=128) == "cudnn"
  with pytest.raises(ValueError, match="head dims up to 128 in multiples of 8, not 192"):
    attention_lib.resolve_impl("cudnn", "gpu", head_dim=192)
