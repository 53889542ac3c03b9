"""Pure-jnp attention in float32: the ground truth every attention kernel here is tested against.

It mirrors the masking of `jaxtrain.ops.attention.xla_attention` (bottom-right aligned causal mask,
equal segment ids attend, 0 is an ordinary id, an optional sliding window of the W most recent
keys) without importing the trainer, so kernels_pallas
stays a standalone package. It materializes [B, K, G, T, S] logits: for tests, not for training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_mask(t: int, s: int, *, causal: bool, segment_ids=None,
                   window: int | None = None) -> jax.Array:
  """Boolean [B or 1, T, S]: causal (diagonal aligned to the bottom-right), within the window
  (query i sees key j iff 0 <= i + S - T - j < window) and same-segment."""
  mask_TS = jnp.ones((t, s), dtype=bool)
  if causal:
    mask_TS = jnp.tril(mask_TS, k=s - t)
  if window is not None:
    mask_TS = jnp.triu(mask_TS, k=s - t - window + 1)
  mask_BTS = mask_TS[None]
  if segment_ids is not None:
    mask_BTS = mask_BTS & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return mask_BTS


def reference_attention(q_BTHE, k_BSKE, v_BSKE, *, causal=True, segment_ids=None,
                        sm_scale=None, window=None) -> jax.Array:
  """Grouped-query attention computed entirely in float32; returns float32 [B, T, H, E].

  Args:
    q_BTHE: queries.
    k_BSKE: keys; K divides H and query head h reads kv head h // (H // K).
    v_BSKE: values.
    causal: mask keys after the query (aligned so the last query sees the last key).
    segment_ids: optional int [B, T] document ids for packed self-attention (requires S == T).
    sm_scale: logit scale, E**-0.5 by default.
    window: optional sliding window W (needs causal): each query sees its W most recent keys.
  """
  if window is not None and not causal:
    raise ValueError(f"window={window} needs causal=True")
  b, t, h, e = q_BTHE.shape
  s, k = k_BSKE.shape[1], k_BSKE.shape[2]
  sm_scale = e ** -0.5 if sm_scale is None else sm_scale
  q_BTKGE = q_BTHE.astype(jnp.float32).reshape(b, t, k, h // k, e)
  logits_BKGTS = jnp.einsum("BTKGE,BSKE->BKGTS", q_BTKGE, k_BSKE.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * sm_scale
  mask_BTS = reference_mask(t, s, causal=causal, segment_ids=segment_ids, window=window)
  mask_B11TS = mask_BTS[:, None, None]
  logits_BKGTS = jnp.where(mask_B11TS, logits_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
  out_BTKGE = jnp.einsum("BKGTS,BSKE->BTKGE", probs_BKGTS, v_BSKE.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
  return out_BTKGE.reshape(b, t, h, e)
