"""QK-clip (MuonClip, Kimi K2): after the optimizer's update, every attention head whose largest
pre-softmax logit in the step passed the threshold tau has its query and key weights scaled so
that the same inputs would give a largest logit of tau: gamma_h = min(1, tau / max_logit_h).

A logit is q_h . k_h, bilinear in the two projections, so the factors of the query and key
weights of a head multiply to gamma_h:

- grouped-query attention (`wq_DHE`, `wk_DKE`, their biases when the family has them): a key
  head is shared by the G query heads of its group, so it takes sqrt(min of their gammas) and
  each query head the rest of its own gamma (gamma_h / that), so every head's logits scale by
  exactly its gamma and heads under the threshold are unchanged;
- multi-head latent attention (DeepSeek-V3, Kimi K2; as Kimi K2 describes): the head-specific
  parts only, the query's and key's non-rotary parts (`wq_b_QHE` / `wq_DHE` columns [:N],
  `wkv_b_RHB` columns [:N]) by sqrt(gamma) each and the query's rotary part by gamma; the
  rotary key is shared by all heads and left alone.

Heads are found by name in the params tree, one attention module per layer, in tree order: the
order the layers report their maxima in (models/attention_stats.py). Per-head norms after the
projections (Qwen3, Gemma 3) would undo the scaling, so config checks refuse QK-clip there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Leaves of a grouped-query attention module the clip scales: name -> the query's or the key's.
_GQA = {"wq_DHE": "q", "bq_HE": "q", "wk_DKE": "k", "bk_KE": "k"}
_MLA_QUERY = ("wq_b_QHE", "wq_DHE")
_MLA_KEY = "wkv_b_RHB"


def _key_name(k) -> Any:
  return getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))


def clip_factors(max_logit_LH: jax.Array, threshold: float) -> jax.Array:
  """gamma [L, H]: min(1, threshold / max logit), 1 for heads at or under the threshold (and
  for heads that saw no keys: -inf)."""
  m = max_logit_LH.astype(jnp.float32)
  return jnp.where(m > threshold, threshold / jnp.where(m > threshold, m, 1.0), 1.0)


def _attention_modules(params) -> list[tuple[tuple, dict[str, tuple]]]:
  """[(module path, {leaf name: (leaf index in the flattened tree, leaf)})] of every attention
  module that has the projections QK-clip scales, in tree order."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  modules: dict[tuple, dict[str, tuple]] = {}
  for i, (path, leaf) in enumerate(leaves):
    names = [_key_name(k) for k in path]
    for j, name in enumerate(names):
      if name in _GQA or name in _MLA_QUERY or name == _MLA_KEY:
        modules.setdefault(tuple(names[:j]), {})[name] = (i, leaf)
        break
  return list(modules.items())


def qk_clip(params, max_logit_LH: jax.Array, threshold: float, rope_head_dim: int = 0):
  """`params` with each attention head's query/key weights scaled by QK-clip's factors, from
  the step's per-layer per-head maxima `max_logit_LH` (rows in tree order of the attention
  modules; a module of a scanned stack [L, ...] takes L rows). `rope_head_dim`: multi-head
  latent attention's rotary part of each query head (its last columns)."""
  gamma_LH = clip_factors(max_logit_LH, threshold)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  row = 0
  for _, module in _attention_modules(params):
    latent = _MLA_KEY in module
    query = next(n for n in (_MLA_QUERY if latent else ("wq_DHE",)) if n in module)
    q_leaf = module[query][1]
    stacked = q_leaf.ndim - 3  # 0 (one layer) or 1 (a scanned stack [L, ...])
    rows = q_leaf.shape[0] if stacked else 1
    gamma = gamma_LH[row:row + rows]
    if not stacked:
      gamma = gamma[0]
    row += rows
    if latent:
      scales = _latent_scales(gamma, q_leaf.shape[-1], module[_MLA_KEY][1].shape[-1],
                              rope_head_dim)
    else:
      scales = _grouped_scales(gamma, module["wk_DKE"][1].shape[-2])
    for name, (i, leaf) in module.items():
      # [(L,) H, columns] (a grouped-query factor is per head: one column for all), with ones
      # for the leaf's input dims between the stack and the heads.
      factor = scales[name] if latent else scales[_GQA[name]][..., None]
      shape = factor.shape[:stacked] + (1,) * (leaf.ndim - factor.ndim) + factor.shape[stacked:]
      leaves[i] = (leaf * factor.reshape(shape)).astype(leaf.dtype)
  if row != gamma_LH.shape[0]:
    raise ValueError(f"{row} attention layers in the params for {gamma_LH.shape[0]} rows of "
                     f"max logits")
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _grouped_scales(gamma_H: jax.Array, kv_heads: int) -> dict[str, jax.Array]:
  """{"q": [(L,) H], "k": [(L,) K]}: each key head sqrt(min gamma of its query group), each
  query head its gamma over its key head's factor."""
  h = gamma_H.shape[-1]
  grouped = gamma_H.reshape(*gamma_H.shape[:-1], kv_heads, h // kv_heads)
  k_K = jnp.sqrt(jnp.min(grouped, axis=-1))
  q_H = (grouped / k_K[..., None]).reshape(gamma_H.shape)
  return {"q": q_H, "k": k_K}


def _latent_scales(gamma_H: jax.Array, q_dim: int, kv_dim: int,
                   rope_head_dim: int) -> dict[str, jax.Array]:
  """Per leaf [(L,) H, columns]: the query's non-rotary columns and the key's by sqrt(gamma),
  the query's rotary columns by gamma, the values' columns (wkv_b's after the key's) by 1."""
  nope = q_dim - rope_head_dim
  root = jnp.sqrt(gamma_H)[..., None]
  ones = lambda n: jnp.ones(gamma_H.shape + (n,), jnp.float32)
  q_HE = jnp.concatenate([root * ones(nope), gamma_H[..., None] * ones(rope_head_dim)], -1)
  kv_HB = jnp.concatenate([root * ones(nope), ones(kv_dim - nope)], -1)
  return {**{n: q_HE for n in _MLA_QUERY}, _MLA_KEY: kv_HB}
