"""The chunked cross-entropy: equal to the naive one, and never holding [B, T, V] float32 logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.ops.cross_entropy import (chunked_cross_entropy, sequence_cross_entropy,
                                    token_cross_entropy)


def naive_cross_entropy(x_BTD, w_DV, targets_BT, mask_BT):
  logits_BTV = jnp.einsum("BTD,DV->BTV", x_BTD, w_DV, preferred_element_type=jnp.float32)
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT)


def _inputs(b, t, d, v, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (b, t, d))
  w = jax.random.normal(k[1], (d, v)) / np.sqrt(d)
  targets = jax.random.randint(k[2], (b, t), 0, v)
  mask = (jax.random.uniform(k[3], (b, t)) > 0.2).astype(jnp.float32)
  return x, w, targets, mask


@pytest.mark.parametrize("explicit_transpose_for_dw", [False, True])
@pytest.mark.parametrize("t,chunk", [(32, 8), (30, 8), (16, 64)])  # divides, ragged, one chunk
def test_matches_naive_loss_and_grads(t, chunk, explicit_transpose_for_dw):
  x, w, targets, mask = _inputs(3, t, 16, 50)
  got = chunked_cross_entropy(x, w, targets, mask, chunk, explicit_transpose_for_dw)
  want = naive_cross_entropy(x, w, targets, mask)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert float(got[1]) == float(want[1])
  g_got = jax.grad(lambda x, w: chunked_cross_entropy(x, w, targets, mask, chunk,
                                                     explicit_transpose_for_dw)[0],
                   argnums=(0, 1))(x, w)
  g_want = jax.grad(lambda x, w: naive_cross_entropy(x, w, targets, mask)[0],
                    argnums=(0, 1))(x, w)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_large_vocab_temporaries_stay_below_full_logits():
  """Compiled forward+backward at V=128256: temporaries far below one [B, T, V] f32 array."""
  b, t, d, v, chunk = 2, 1024, 64, 128256, 128
  args = [jax.ShapeDtypeStruct((b, t, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
          jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.float32)]

  def temp_bytes(loss):
    grad = jax.grad(lambda x, w, tg, m: loss(x, w, tg, m)[0], argnums=(0, 1))
    return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

  full_logits = b * t * v * 4  # 1.05 GB
  chunked = temp_bytes(lambda x, w, tg, m: chunked_cross_entropy(x, w, tg, m, chunk))
  naive = temp_bytes(naive_cross_entropy)
  assert naive >= full_logits
  # Measured on CPU: 252 MiB fused and chunked (a few [B, chunk, V] buffers) vs 4008 MiB naive.
  assert chunked < full_logits / 2, (chunked, naive)
  assert chunked < naive / 8, (chunked, naive)


def test_a_tied_table_is_contracted_as_stored():
  """The head given as a [V, D] table (vocab_axis=0) gives the [D, V] head's loss and gradients
  (the table's gradient transposed), for all three chunked losses."""
  x, w_DV, targets, mask = _inputs(3, 30, 16, 50)
  w_VD = w_DV.T
  losses = {
      "sum": lambda w, axis: chunked_cross_entropy(x, w, targets, mask, 8, False, axis)[0],
      "rows": lambda w, axis: jnp.sum(sequence_cross_entropy(x, w, targets, mask, 8, axis)),
      "tokens": lambda w, axis: jnp.sum(token_cross_entropy(x, w, targets, 8, axis) * mask),
  }
  for name, loss in losses.items():
    np.testing.assert_allclose(loss(w_VD, 0), loss(w_DV, 1), rtol=1e-6, err_msg=name)
    g_VD = jax.grad(loss)(w_VD, 0)
    np.testing.assert_allclose(g_VD.T, jax.grad(loss)(w_DV, 1), atol=1e-6, err_msg=name)


def test_a_tied_table_is_not_copied_transposed():
  """Compiled forward+backward with a frozen [V, D] table: contracted as stored, the step needs
  at least the table's size less than with the table transposed first (measured on CPU: 12.7
  against 29.4 MB for a 4 MiB table)."""
  b, t, d, v, chunk = 1, 256, 64, 32768, 64
  args = [jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16), jax.ShapeDtypeStruct((v, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.float32)]

  def temp_bytes(loss):
    grad = jax.grad(lambda x, w, tg, m: loss(x, w, tg, m)[0])  # x only: the table is frozen
    return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

  as_stored = temp_bytes(lambda x, w, tg, m: chunked_cross_entropy(x, w, tg, m, chunk, False, 0))
  transposed = temp_bytes(lambda x, w, tg, m: chunked_cross_entropy(x, w.T, tg, m, chunk))
  assert as_stored <= transposed - v * d * 2, (as_stored, transposed)
