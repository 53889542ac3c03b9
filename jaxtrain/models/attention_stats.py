"""The attention layers' largest logits of the forward passes traced inside `collect_max_logits()`:
the same trace-time side channel as the router statistics (models/moe.collect_router_stats),
so the objectives hand them to the train step (QK-clip, the attn_max_logit metric) without
every model call returning them.

One report per forward pass: [L, H] float32, one row per attention layer in the params tree's
order of attention modules (dense stack, main stack, multi-token-prediction modules), which is
the order train/qk_clip.py scales their weights in.
"""

from __future__ import annotations

import contextlib

import jax

_COLLECTIONS: list[list[jax.Array]] = []


@contextlib.contextmanager
def collect_max_logits():
  """Collects the max-logit reports of the forward passes traced inside the block: a list, one
  [L, H] array per pass (nothing when the model does not track them)."""
  collected: list[jax.Array] = []
  _COLLECTIONS.append(collected)
  try:
    yield collected
  finally:
    _COLLECTIONS.pop()


def report_max_logits(max_logit_LH: jax.Array) -> None:
  """Hands a forward pass's [L, H] to the innermost open collection (if any)."""
  if _COLLECTIONS:
    _COLLECTIONS[-1].append(max_logit_LH)
