"""The largest pre-softmax attention logit of each head: what QK-clip (train/qk_clip.py) and the
`attn_max_logit` metric read.

Computed from the queries and keys the attention sublayer already has, beside whichever
attention impl runs (xla, cuDNN, our Pallas kernels, blockwise): none of them has to hand its
logits out, so every impl reports the same figure. It costs one more Q.K^T per layer in the
forward pass, none in the backward (the inputs' gradients are stopped, and a remat's
recomputation drops it: nothing in the backward reads it). Queries go in chunks, so at most
[B, K, G, chunk, S] scores are live at once however long the sequence.

The mask is the attention's, from positions and segments (so it holds in any sequence layout):
a query sees the keys of its own segment at positions <= its own, within `window` if one is
given; segment 0 is padding and sees nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The attention sublayer's statistic of this name: [H] per layer, stacked [L, H] by the layer loop.
MAX_LOGIT = "attn_max_logit"

# The objectives hand each attention layer's per-head maxima [L, H] to the train step under this
# key (QK-clip); the step takes it out of the metrics before they are logged.
HEAD_MAX_LOGITS = "attn_max_logit_LH"
METRIC_NAMES = (MAX_LOGIT,)  # logged per step (metrics.jsonl, TensorBoard)

# Scores per (row, head) in one chunk: chunk x S <= this (4 MiB of float32).
_CHUNK_SCORES = 1 << 20


def _chunk(t: int, s: int) -> int:
  """The largest divisor of t with chunk * s <= _CHUNK_SCORES (at least 1)."""
  best = 1
  for c in range(1, t + 1):
    if t % c == 0 and c * s <= _CHUNK_SCORES:
      best = c
  return best


def max_logit_per_head(q_BTHE: jax.Array, k_BSKE: jax.Array, positions_BT: jax.Array,
                       segment_ids_BT: jax.Array | None, *, sm_scale: float | None = None,
                       causal: bool = True, window: int | jax.Array | None = None) -> jax.Array:
  """max over the batch, queries and the keys each query attends to of sm_scale * q.k, per
  query head [H], float32 (-inf for a head no query attends with: all padding).

  `k_BSKE` may have fewer heads than the queries (grouped-query attention: query head h reads
  key head h // (H / K)); self-attention (S = T, the keys at the queries' positions)."""
  b, t, h, e = q_BTHE.shape
  s, kv = k_BSKE.shape[1], k_BSKE.shape[2]
  scale = e ** -0.5 if sm_scale is None else sm_scale
  q = jax.lax.stop_gradient(q_BTHE).reshape(b, t, kv, h // kv, e)
  k = jax.lax.stop_gradient(k_BSKE)
  seg = jnp.ones((b, t), jnp.int32) if segment_ids_BT is None else segment_ids_BT
  c = _chunk(t, s)
  # [n, B, c, ...]: chunk i holds queries [i c, (i + 1) c).
  split = lambda x: jnp.moveaxis(x.reshape(b, t // c, c, *x.shape[2:]), 1, 0)

  def chunk_max(args):
    q_BcKGE, pos_Bc, seg_Bc = args
    scores_BKGcS = jnp.einsum("bckge,bske->bkgcs", q_BcKGE, k,
                              preferred_element_type=jnp.float32) * scale
    seen_BcS = (seg_Bc[:, :, None] == seg[:, None, :]) & (seg_Bc[:, :, None] > 0)
    if causal:
      seen_BcS &= positions_BT[:, None, :] <= pos_Bc[:, :, None]
    if window is not None:
      # A traced window <= 0 (stacked layers of both types): no window on that layer.
      inside = pos_Bc[:, :, None] - positions_BT[:, None, :] < window
      seen_BcS &= inside | (jnp.asarray(window) <= 0)
    masked = jnp.where(seen_BcS[:, None, None], scores_BKGcS, -jnp.inf)
    return jnp.max(masked, axis=(0, 3, 4)).reshape(h)

  per_chunk_nH = jax.lax.map(chunk_max, (split(q), split(positions_BT), split(seg)))
  return jnp.max(per_chunk_nH, axis=0)
