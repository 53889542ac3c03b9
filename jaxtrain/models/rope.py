"""Rotary position embeddings: inverse frequencies (plain, Llama 3's scaling, linear) and their
application in the Hugging Face layout."""

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
  """
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if not scaling:
    return inv_freq.astype(np.float32)
  if scaling["type"] == "linear":
    return (inv_freq / scaling["factor"]).astype(np.float32)
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BTNE: jax.Array, positions_BT: jax.Array, inv_freq) -> jax.Array:
  """Rotates pairs (i, i + E/2) by position * frequency (the Hugging Face Llama layout).
  `inv_freq` [E/2] is a constant, or traced where a layer picks its RoPE at run time."""
  angles_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq
  cos_BT1F = jnp.cos(angles_BTF)[:, :, None]
  sin_BT1F = jnp.sin(angles_BTF)[:, :, None]
  x1, x2 = jnp.split(x_BTNE.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos_BT1F - x2 * sin_BT1F, x2 * cos_BT1F + x1 * sin_BT1F], axis=-1)
  return out.astype(x_BTNE.dtype)
