"""Rotary position embeddings: inverse frequencies (plain, Llama 3's scaling, linear, YaRN) and
their application in the Hugging Face layout."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
  """Inverse frequencies [E/2], scaled as `scaling["type"]` says when given.

  llama3: leaves high frequencies (short wavelengths) alone, divides low frequencies by `factor`,
    and interpolates smoothly in between, so long contexts stretch only the slow rotations.
  linear: every frequency divided by `factor` (positions interpolated; Gemma 3's global layers).
  yarn: (YaRN, Peng et al. 2023; DeepSeek-V3) frequencies that turn more than `beta_fast` times
    over the original context are kept, those that turn fewer than `beta_slow` times are
    divided by `factor`, with a linear ramp between (over dims rounded outward); the softmax
    sharpening that goes with it is `rope_attention_factor`.
  """
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if not scaling:
    return inv_freq.astype(np.float32)
  if scaling["type"] == "linear":
    return (inv_freq / scaling["factor"]).astype(np.float32)
  if scaling["type"] == "yarn":
    return _yarn_inv_freq(inv_freq, head_dim, theta, scaling).astype(np.float32)
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


# YaRN's fields (spelled as transformers spells them; model.rope_scaling holds the same names).
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim")


def _yarn_inv_freq(inv_freq: np.ndarray, head_dim: int, theta: float, scaling: dict):
  factor = float(scaling["factor"])
  old_len = float(scaling["original_max_position_embeddings"])

  def dim_turning(turns: float) -> float:
    # The (fractional) dim index whose frequency turns `turns` times over old_len positions.
    return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(dim_turning(float(scaling["beta_fast"]))), 0)
  high = min(math.ceil(dim_turning(float(scaling["beta_slow"]))), head_dim - 1)
  if low == high:
    high += 0.001  # a ramp of one dim, not a division by zero
  # 0: the original frequency (fast dims), 1: interpolated (slow dims).
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  return inv_freq / factor * ramp + inv_freq * (1.0 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature term, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
  """What YaRN multiplies the rotated queries and keys by (so their logits by its square):
  mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (DeepSeek-V3,
  where the two cancel and the softmax scale carries mscale_all_dim instead), else
  mscale(factor). 1.0 for the other scalings."""
  if not scaling or scaling["type"] != "yarn":
    return 1.0
  factor = float(scaling["factor"])
  mscale, mscale_all_dim = float(scaling["mscale"]), float(scaling["mscale_all_dim"])
  if mscale and mscale_all_dim:
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  return yarn_mscale(factor)


def apply_rope(x_BTNE: jax.Array, positions_BT: jax.Array, inv_freq,
               attention_factor: float = 1.0) -> jax.Array:
  """Rotates pairs (i, i + E/2) by position * frequency (the Hugging Face Llama layout), times
  `attention_factor` (YaRN's; 1.0 otherwise). `inv_freq` [E/2] is a constant, or traced where a
  layer picks its RoPE at run time."""
  angles_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq
  cos_BT1F = jnp.cos(angles_BTF)[:, :, None]
  sin_BT1F = jnp.sin(angles_BTF)[:, :, None]
  if not (isinstance(attention_factor, float) and attention_factor == 1.0):
    cos_BT1F, sin_BT1F = cos_BT1F * attention_factor, sin_BT1F * attention_factor
  x1, x2 = jnp.split(x_BTNE.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos_BT1F - x2 * sin_BT1F, x2 * cos_BT1F + x1 * sin_BT1F], axis=-1)
  return out.astype(x_BTNE.dtype)
