"""Exact attention over (query tile, key tile) pairs in plain jnp, with explicit positions.

The building block of context-parallel attention. Every query and key carries its index in the
original sequence (`qidx_T`, `kidx_S`), so the keys may be any part of the sequence, in any order:
a device's own part, the whole gathered sequence, or the part passing by on the ring. Causality
is `kidx <= qidx` within a segment, never a [T, S] mask; a tile whose keys all come after its
queries is skipped (`lax.cond`), which is where causal attention saves half its FLOPs.

The softmax is online (flash attention): running statistics per query row, the max `m`, the sum
`l` and the unnormalized output `acc`, are updated tile by tile, so keys can arrive in several
calls (ring steps) before `finalize`. The backward pass recomputes each tile's probabilities
from the final log-sum-exp. Shapes: q_BTHE, k_BSKE, v_BSKE; H = K * G query heads per kv head;
statistics are kept per query tile: m/l [N, B, K, G, t], acc [N, B, K, G, t, E], float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

DEFAULT_TILE = 256
_MASKED = jnp.finfo(jnp.float32).min  # finite, so max/exp never give NaN


class Stats(NamedTuple):
  m: jax.Array  # [N, B, K, G, t] running max of the scores
  l: jax.Array  # [N, B, K, G, t] running sum of exp(score - m)
  acc: jax.Array  # [N, B, K, G, t, E] running sum of exp(score - m) * v


def fit_tile(tile: int, length: int) -> int:
  """The largest divisor of `length` that is at most `tile`: tiles cover it exactly, with no
  padded rows (a padded query row would see no key at all)."""
  tile = max(1, min(tile, length))
  while length % tile:
    tile -= 1
  return tile


def _tiles(x, size: int):
  """[B, L, ...] -> [L/size, B, size, ...]."""
  b, n = x.shape[0], x.shape[1] // size
  return x.reshape(b, n, size, *x.shape[2:]).swapaxes(0, 1)


def _untile(x_NBt):
  """[N, B, t, ...] -> [B, N*t, ...]."""
  n, b, t = x_NBt.shape[:3]
  return x_NBt.swapaxes(0, 1).reshape(b, n * t, *x_NBt.shape[3:])


def tile_gradients(s_BKGTC, lse_BKGT, d_BKGT, q_BTKGE, k_BCKE, v_BCKE, dout_BTKGE, sm_scale):
  """One (query tile, key tile) pair's share of the attention backward pass, from the pair's
  scaled, masked scores and the rows' final log-sum-exp `lse` and D = rowsum(dO * O): (dq to
  add [B, T, K, G, E], dk [B, C, K, E], dv [B, C, K, E]), accumulated in float32. The blockwise
  attention's backward (blockwise_attention.py) runs it per key block."""
  p_BKGTC = jnp.exp(s_BKGTC - lse_BKGT[..., None])
  dv_BCKE = jnp.einsum("BKGTC,BTKGE->BCKE", p_BKGTC.astype(dout_BTKGE.dtype), dout_BTKGE,
                       preferred_element_type=jnp.float32)
  dp_BKGTC = jnp.einsum("BTKGE,BCKE->BKGTC", dout_BTKGE, v_BCKE,
                        preferred_element_type=jnp.float32)
  ds_BKGTC = (p_BKGTC * (dp_BKGTC - d_BKGT[..., None]) * sm_scale).astype(q_BTKGE.dtype)
  dq_BTKGE = jnp.einsum("BKGTC,BCKE->BTKGE", ds_BKGTC, k_BCKE, preferred_element_type=jnp.float32)
  dk_BCKE = jnp.einsum("BKGTC,BTKGE->BCKE", ds_BKGTC, q_BTKGE, preferred_element_type=jnp.float32)
  return dq_BTKGE, dk_BCKE, dv_BCKE

def _visible(qidx_t, kidx_c, causal: bool):
  """Whether any key of the tile may be seen by any query of the tile."""
  return jnp.min(kidx_c) <= jnp.max(qidx_t) if causal else jnp.bool_(True)


def _scores(q_BtKGE, k_BcKE, qseg_Bt, kseg_Bc, qidx_t, kidx_c, causal, sm_scale):
  """Masked float32 scores [B, K, G, t, c]."""
  s_BKGtc = jnp.einsum("BTKGE,BCKE->BKGTC", q_BtKGE, k_BcKE,
                       preferred_element_type=jnp.float32) * sm_scale
  mask_Btc = qseg_Bt[:, :, None] == kseg_Bc[:, None, :]
  if causal:
    mask_Btc = mask_Btc & (kidx_c[None, None, :] <= qidx_t[None, :, None])
  return jnp.where(mask_Btc[:, None, None], s_BKGtc, _MASKED)


def init_stats(q_BTHE, num_kv_heads: int, tile_q: int) -> Stats:
  b, t, h, e = q_BTHE.shape
  shape = (t // tile_q, b, num_kv_heads, h // num_kv_heads, tile_q)
  return Stats(jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
               jnp.zeros(shape + (e,), jnp.float32))


def accumulate(stats: Stats, q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, qidx_T, kidx_S, *,
               causal: bool, sm_scale: float, tile_q: int, tile_k: int) -> Stats:
  """`stats` updated with the keys and values of k_BSKE / v_BSKE (tiles of tile_k)."""
  b, t, h, e = q_BTHE.shape
  kv = k_BSKE.shape[2]
  q_tiles = (_tiles(q_BTHE.reshape(b, t, kv, h // kv, e), tile_q), _tiles(qseg_BT, tile_q),
             qidx_T.reshape(-1, tile_q))
  k_tiles = (_tiles(k_BSKE, tile_k), _tiles(v_BSKE, tile_k), _tiles(kseg_BS, tile_k),
             kidx_S.reshape(-1, tile_k))

  def per_query_tile(_, xs):
    (q_BtKGE, qseg_Bt, qidx_t), tile_stats = xs

    # Checkpointed: under remat, JAX would otherwise stack the integer-only masks of all tiles.
    @jax.checkpoint
    def per_key_tile(carry, ys):
      k_BcKE, v_BcKE, kseg_Bc, kidx_c = ys

      def update(carry):
        m, l, acc = carry
        s_BKGtc = _scores(q_BtKGE, k_BcKE, qseg_Bt, kseg_Bc, qidx_t, kidx_c, causal, sm_scale)
        m_new = jnp.maximum(m, s_BKGtc.max(-1))
        p_BKGtc = jnp.exp(s_BKGtc - m_new[..., None])
        correction = jnp.exp(m - m_new)
        pv_BKGtE = jnp.einsum("BKGTC,BCKE->BKGTE", p_BKGtc.astype(v_BcKE.dtype), v_BcKE,
                              preferred_element_type=jnp.float32)
        return (m_new, l * correction + p_BKGtc.sum(-1), acc * correction[..., None] + pv_BKGtE)

      visible = _visible(qidx_t, kidx_c, causal)
      return jax.lax.cond(visible, update, lambda c: c, carry), None

    out, _ = jax.lax.scan(per_key_tile, tuple(tile_stats), k_tiles)
    return None, out

  _, (m, l, acc) = jax.lax.scan(per_query_tile, None, (q_tiles, tuple(stats)))
  return Stats(m, l, acc)


def finalize(stats: Stats, dtype) -> tuple[jax.Array, jax.Array]:
  """(out [B, T, H, E] in `dtype`, log-sum-exp [N, B, K, G, t] float32)."""
  out_NBKGtE = stats.acc / stats.l[..., None]
  n, b, k, g, t, e = out_NBKGtE.shape
  out_BTHE = out_NBKGtE.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * t, k * g, e)
  return out_BTHE.astype(dtype), stats.m + jnp.log(stats.l)


def row_dot(out_BTHE, dout_BTHE, num_kv_heads: int, tile_q: int) -> jax.Array:
  """D = rowsum(dO * O) [N, B, K, G, t]: the softmax backward's correction, once per query."""
  b, t, h, e = out_BTHE.shape
  d_BTH = jnp.sum(out_BTHE.astype(jnp.float32) * dout_BTHE.astype(jnp.float32), axis=-1)
  d_NBtKG = _tiles(d_BTH.reshape(b, t, num_kv_heads, h // num_kv_heads), tile_q)
  return d_NBtKG.transpose(0, 1, 3, 4, 2)


def gradients(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, qidx_T, kidx_S, dout_BTHE, lse, d, *,
              causal: bool, sm_scale: float, tile_q: int, tile_k: int):
  """float32 (dq [B, T, H, E], dk [B, S, K, E], dv [B, S, K, E]) of this key range's share of
  the attention output, given the final log-sum-exp `lse` and `d` (row_dot)."""
  b, t, h, e = q_BTHE.shape
  s, kv = k_BSKE.shape[1], k_BSKE.shape[2]
  g = h // kv
  q_tiles = (_tiles(q_BTHE.reshape(b, t, kv, g, e), tile_q),
             _tiles(dout_BTHE.reshape(b, t, kv, g, e), tile_q), _tiles(qseg_BT, tile_q),
             qidx_T.reshape(-1, tile_q), lse, d)
  k_tiles = (jnp.arange(s // tile_k), _tiles(k_BSKE, tile_k), _tiles(v_BSKE, tile_k),
             _tiles(kseg_BS, tile_k), kidx_S.reshape(-1, tile_k))

  def per_query_tile(dkv, xs):
    q_BtKGE, dout_BtKGE, qseg_Bt, qidx_t, lse_BKGt, d_BKGt = xs

    def per_key_tile(carry, ys):
      j, k_BcKE, v_BcKE, kseg_Bc, kidx_c = ys

      def update(carry):
        dq_BtKGE, dk_BSKE, dv_BSKE = carry
        s_BKGtc = _scores(q_BtKGE, k_BcKE, qseg_Bt, kseg_Bc, qidx_t, kidx_c, causal, sm_scale)
        ddq_BtKGE, dk_BcKE, dv_BcKE = tile_gradients(
            s_BKGtc, lse_BKGt, d_BKGt, q_BtKGE, k_BcKE, v_BcKE, dout_BtKGE, sm_scale)
        dq_BtKGE = dq_BtKGE + ddq_BtKGE
        start = (0, j * tile_k, 0, 0)
        add = lambda acc, x: jax.lax.dynamic_update_slice(
            acc, jax.lax.dynamic_slice(acc, start, x.shape) + x, start)
        return dq_BtKGE, add(dk_BSKE, dk_BcKE), add(dv_BSKE, dv_BcKE)

      return jax.lax.cond(_visible(qidx_t, kidx_c, causal), update, lambda c: c, carry), None

    dq0 = jnp.zeros(q_BtKGE.shape, jnp.float32)
    (dq_BtKGE, dk, dv), _ = jax.lax.scan(per_key_tile, (dq0, *dkv), k_tiles)
    return (dk, dv), dq_BtKGE

  zeros = jnp.zeros((b, s, kv, e), jnp.float32)
  (dk_BSKE, dv_BSKE), dq_NBtKGE = jax.lax.scan(per_query_tile, (zeros, zeros), q_tiles)
  return _untile(dq_NBtKGE).reshape(b, t, h, e), dk_BSKE, dv_BSKE


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def tiled_attention(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, qidx_T, kidx_S, causal, sm_scale,
                    tile_q, tile_k):
  """Attention of the queries over all of the given keys (one call: no ring)."""
  return _tiled_fwd(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, qidx_T, kidx_S, causal, sm_scale,
                    tile_q, tile_k)[0]


def _tiled_fwd(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, qidx_T, kidx_S, causal, sm_scale,
               tile_q, tile_k):
  stats = accumulate(init_stats(q_BTHE, k_BSKE.shape[2], tile_q), q_BTHE, k_BSKE, v_BSKE,
                     qseg_BT, kseg_BS, qidx_T, kidx_S, causal=causal, sm_scale=sm_scale,
                     tile_q=tile_q, tile_k=tile_k)
  out_BTHE, lse = finalize(stats, q_BTHE.dtype)
  return out_BTHE, (q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, qidx_T, kidx_S, out_BTHE, lse)


def _tiled_bwd(causal, sm_scale, tile_q, tile_k, residuals, dout_BTHE):
  q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, qidx_T, kidx_S, out_BTHE, lse = residuals
  d = row_dot(out_BTHE, dout_BTHE, k_BSKE.shape[2], tile_q)
  dq, dk, dv = gradients(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, qidx_T, kidx_S, dout_BTHE,
                         lse, d, causal=causal, sm_scale=sm_scale, tile_q=tile_q, tile_k=tile_k)
  return (dq.astype(q_BTHE.dtype), dk.astype(k_BSKE.dtype), dv.astype(v_BSKE.dtype), None, None,
          None, None)


# optimize_remat: under a remat policy the forward stays one opaque call, like a fused kernel.
tiled_attention.defvjp(_tiled_fwd, _tiled_bwd, optimize_remat=True)
