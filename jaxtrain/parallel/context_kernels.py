"""Context-parallel attention with our Pallas flash-attention kernels per chunk pair (GPU).

The sequence layout cuts a sequence into chunks (2C in the load-balanced layout, C without), and
every device holds whole chunks. Between a query chunk and a key chunk causality is all or
nothing or the diagonal: keys of a later chunk are all invisible (skipped), of an earlier chunk
all visible (the kernel with causal=False), of the same chunk causal (causal=True, equal lengths).
So the per-device work is a set of plain kernel calls, chosen at run time (`lax.switch` on the
chunk ids: which chunk a device holds depends on its index), merged by their log-sum-exp. The
backward pass calls the kernels' backward per pair with the final output and log-sum-exp, which
is exactly the pair's share of dQ, dK, dV (FlashAttention-2's decomposition).

Used by jaxtrain.parallel.context_attention for both strategies; shapes inside shard_map: q_BLHE (L local
positions = n chunks of length c), lse_BHc float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import flash_attention_kernels as fk
from kernels_pallas.flash_attention import _default_blocks  # pylint: disable=protected-access

_EMPTY = -1e30  # log-sum-exp of no keys: finite, so merging two empties gives no NaN


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The flash kernels for chunks of `chunk` positions (a hashable custom_vjp static)."""
  sm_scale: float
  chunk: int
  block_q: int
  block_k: int
  interpret: bool
  num_warps: int

  def config(self, causal: bool) -> fk.FlashConfig:
    return fk.FlashConfig(causal=causal, sm_scale=self.sm_scale, t=self.chunk, s=self.chunk,
                          block_q=self.block_q, block_k=self.block_k, interpret=self.interpret,
                          num_warps=self.num_warps, num_stages=2)


def kernels_for(head_dim: int, chunk: int, sm_scale: float, *, platform: str,
                interpret: bool, block_q=None, block_k=None) -> Kernels | None:
  """The kernels for this chunk length, or None where they cannot tile it exactly (the caller
  then uses the jnp tiles)."""
  default_q, default_k = _default_blocks("flash", platform, interpret, head_dim, chunk, chunk)
  block_q, block_k = min(block_q or default_q, chunk), min(block_k or default_k, chunk)
  if chunk % block_q or chunk % block_k:
    return None
  return Kernels(sm_scale=sm_scale, chunk=chunk, block_q=block_q, block_k=block_k,
                 interpret=interpret, num_warps=4 if head_dim <= 64 else 8)


def _split(x, n: int):
  return jnp.split(x, n, axis=1)


def _mode(gq, gk):
  """0: skip (the key chunk follows the query chunk), 1: diagonal (causal), 2: all visible."""
  return jnp.where(gk > gq, 0, jnp.where(gk == gq, 1, 2))


def _pair_forward(kernels: Kernels, q, k, v, qseg, kseg, gq, gk):
  """(out [B, c, H, E] float32, lse [B, H, c]) of one query chunk over one key chunk."""
  b, c, h, e = q.shape

  def skip(*_):
    return jnp.zeros((b, c, h, e), jnp.float32), jnp.full((b, h, c), _EMPTY, jnp.float32)

  def run(causal):
    def call(q, k, v, qseg, kseg):
      out, lse = fk.forward(q, k, v, qseg, kseg, kernels.config(causal))
      return out.astype(jnp.float32), lse
    return call

  return jax.lax.switch(_mode(gq, gk), [skip, run(True), run(False)], q, k, v, qseg, kseg)


def _merge(acc, part):
  """Two (out, lse) partial results of the same queries over disjoint keys, combined."""
  (out_a, lse_a), (out_b, lse_b) = acc, part
  lse = jnp.logaddexp(lse_a, lse_b)
  weight = lambda l: jnp.exp(l - lse).transpose(0, 2, 1)[..., None]  # [B, H, c] -> [B, c, H, 1]
  return out_a * weight(lse_a) + out_b * weight(lse_b), lse


def empty(q_BLHE, n: int):
  """The running (out, lse) per query chunk before any key."""
  b, l, h, e = q_BLHE.shape
  c = l // n
  return [(jnp.zeros((b, c, h, e), jnp.float32), jnp.full((b, h, c), _EMPTY, jnp.float32))
          for _ in range(n)]


def _key_chunk(x, j, chunk: int):
  """Key chunk `j` (traced) of x [B, S, ...]."""
  return jax.lax.dynamic_slice_in_dim(x, j * chunk, chunk, axis=1)


def absorb(kernels: Kernels, acc, q_BLHE, qseg_BL, my_chunks, k_BSKE, v_BSKE, kseg_BS,
           their_chunks):
  """`acc` with the keys of k_BSKE added: their chunks' global ids are `their_chunks` (a
  traced [m] int array), the queries' `my_chunks` ([n]).

  A loop over the m key chunks, not m unrolled copies: at 128K tokens over 8 devices the
  gathered keys are 16 chunks, and unrolled the step held 16 x 2 kernel pairs per layer
  (36 s to compile for H100, against 14 s rolled)."""
  n, m, c = len(acc), k_BSKE.shape[1] // kernels.chunk, kernels.chunk
  qs, qsegs = _split(q_BLHE, n), _split(qseg_BL, n)

  def key_chunk(j, acc):
    k, v, kseg = (_key_chunk(x, j, c) for x in (k_BSKE, v_BSKE, kseg_BS))
    return [_merge(acc[a], _pair_forward(kernels, qs[a], k, v, qsegs[a], kseg, my_chunks[a],
                                         their_chunks[j]))
            for a in range(n)]

  return jax.lax.fori_loop(0, m, key_chunk, list(acc))


def finish(acc, dtype):
  """(out [B, L, H, E] in `dtype`, [lse [B, H, c] per chunk])."""
  return (jnp.concatenate([out for out, _ in acc], axis=1).astype(dtype),
          [lse for _, lse in acc])


def gradients(kernels: Kernels, q_BLHE, qseg_BL, my_chunks, out_BLHE, lses, dout_BLHE, k_BSKE,
              v_BSKE, kseg_BS, their_chunks):
  """float32 (dq [B, L, H, E], dk, dv [B, S, K, E]): the share of these keys, given the final
  output and log-sum-exp of the queries. A loop over the key chunks, as in `absorb`; each
  writes its own chunk of dk and dv."""
  n, m, c = len(lses), k_BSKE.shape[1] // kernels.chunk, kernels.chunk
  qs, qsegs, outs, douts = (_split(x, n) for x in (q_BLHE, qseg_BL, out_BLHE, dout_BLHE))

  def run(causal):
    def call(q, k, v, qseg, kseg, out, lse, dout):
      grads = fk.backward(q, k, v, qseg, kseg, out, lse, dout, kernels.config(causal))
      return tuple(g.astype(jnp.float32) for g in grads)
    return call

  def key_chunk(j, carry):
    dqs, dk_BSKE, dv_BSKE = carry
    k, v, kseg = (_key_chunk(x, j, c) for x in (k_BSKE, v_BSKE, kseg_BS))
    dk = dv = jnp.zeros(k.shape, jnp.float32)
    dqs = list(dqs)
    for a in range(n):
      skip = lambda *_, a=a: (jnp.zeros(qs[a].shape, jnp.float32),
                              jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
      dq_a, dk_a, dv_a = jax.lax.switch(_mode(my_chunks[a], their_chunks[j]),
                                        [skip, run(True), run(False)], qs[a], k, v, qsegs[a],
                                        kseg, outs[a], lses[a], douts[a])
      dqs[a], dk, dv = dqs[a] + dq_a, dk + dk_a, dv + dv_a
    put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, j * c, axis=1)
    return dqs, put(dk_BSKE, dk), put(dv_BSKE, dv)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dqs, dk, dv = jax.lax.fori_loop(0, m, key_chunk,
                                  ([zeros(x) for x in qs], zeros(k_BSKE), zeros(v_BSKE)))
  return jnp.concatenate(dqs, axis=1), dk, dv


def chunk_table(shards: int, balanced: bool) -> np.ndarray:
  """int32 [shards, n]: the global chunk ids each device holds, in its local order (n = 2 in the
  load-balanced layout: chunks i and 2C-1-i; else 1: chunk i)."""
  if balanced:
    return np.array([[i, 2 * shards - 1 - i] for i in range(shards)], np.int32)
  return np.arange(shards, dtype=np.int32)[:, None]
