"""Attention over packed sequences: one signature, several implementations.

Shapes: q_BTHE, k_BSKE, v_BSKE with K kv heads dividing H query heads (grouped-query attention;
K/V are never repeated in memory: queries are regrouped as [B, T, K, G, E]). `segment_ids_BT`
marks packed documents (0 = padding): a token attends only to earlier tokens of its own segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("xla", "cudnn", "auto")


def resolve_impl(impl: str, platform: str | None = None) -> str:
  """Maps `auto` to the best implementation available on the backend."""
  platform = platform or jax.default_backend()
  if impl == "auto":
    return "cudnn" if platform == "gpu" else "xla"
  if impl not in IMPLS:
    raise ValueError(f"attention impl {impl!r} is unknown; choose one of {', '.join(IMPLS)}")
  if impl == "cudnn" and platform != "gpu":
    raise ValueError(f"attention impl 'cudnn' needs a GPU backend (this is {platform!r}); use "
                     f"'xla' or 'auto'")
  return impl


def attention_mask(segment_ids_BT: jax.Array | None, t: int, s: int,
                   causal: bool = True) -> jax.Array:
  """Boolean [B or 1, 1, T, S]: causal and same-segment. Every row keeps its diagonal."""
  mask_TS = jnp.ones((t, s), dtype=bool)
  if causal:
    mask_TS = jnp.tril(mask_TS, k=s - t)
  mask = mask_TS[None, None]
  if segment_ids_BT is not None:
    same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    mask = mask & same_BTS[:, None]
  return mask


def xla_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, causal=True, sm_scale=None):
  """Reference attention in plain jnp: float32 softmax, GQA without repeating K/V."""
  b, t, h, e = q_BTHE.shape
  s, k = k_BSKE.shape[1], k_BSKE.shape[2]
  g = h // k
  sm_scale = e ** -0.5 if sm_scale is None else sm_scale
  q_BTKGE = q_BTHE.reshape(b, t, k, g, e)
  logits_BKGTS = jnp.einsum("BTKGE,BSKE->BKGTS", q_BTKGE, k_BSKE,
                            preferred_element_type=jnp.float32) * sm_scale
  mask_B11TS = attention_mask(segment_ids_BT, t, s, causal)[:, :, None]
  logits_BKGTS = jnp.where(mask_B11TS, logits_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKE.dtype)
  out_BTKGE = jnp.einsum("BKGTS,BSKE->BTKGE", probs_BKGTS, v_BSKE)
  return out_BTKGE.reshape(b, t, h, e)


def cudnn_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, causal=True, sm_scale=None):
  mask = None
  if segment_ids_BT is not None:
    mask = attention_mask(segment_ids_BT, q_BTHE.shape[1], k_BSKE.shape[1], causal=False)
  return jax.nn.dot_product_attention(q_BTHE, k_BSKE, v_BSKE, mask=mask, scale=sm_scale,
                                      is_causal=causal, implementation="cudnn")


def attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, impl="xla", causal=True,
              sm_scale=None):
  """Causal (by default) attention within segments; returns [B, T, H, E] in q's dtype."""
  impl = resolve_impl(impl)
  fn = {"xla": xla_attention, "cudnn": cudnn_attention}[impl]
  return fn(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, causal=causal, sm_scale=sm_scale)
