"""The sequence layout of context parallelism: which tokens each device of the `context` axis holds.

With `mesh.context` = C the sequence dim of activations is split into C equal parts. Under causal
attention the part at the end of the sequence has the most work (its queries see every earlier
key), so by default the sequence is reordered before it is split ("dual chunk swap"): cut into 2C
chunks, device i holds chunks i and 2C-1-i, and every device then has the same number of
visible (query, key) pairs. The reorder is a permutation of the tokens; inputs, targets, loss
mask, positions and segment ids move together, so the summed loss is unchanged and nothing is
ever un-permuted. Attention alone needs to know the original order (causality), and gets it from
`global_positions`.

All functions here are static (numpy) or pure; none depends on a device.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.parallel.mesh import axis_size

STRATEGIES = ("all_gather", "ring")


def context_size(mesh=None) -> int:
  """The size of the `context` axis of `mesh` (default: the current abstract mesh); 1 without."""
  return axis_size("context", mesh)


def global_positions(length: int, shards: int, balanced: bool) -> np.ndarray:
  """int32 [shards, length // shards]: the original sequence index of each local position on
  each device of the `context` axis (row i is device i's part, in its local order)."""
  if balanced and shards > 1:
    if length % (2 * shards):
      raise ValueError(f"a sequence of {length} tokens does not split into 2*{shards} equal "
                       f"chunks for the load-balanced context layout")
    chunk = length // (2 * shards)
    rows = [np.concatenate([np.arange(i * chunk, (i + 1) * chunk),
                            np.arange((2 * shards - 1 - i) * chunk, (2 * shards - i) * chunk)])
            for i in range(shards)]
    return np.stack(rows).astype(np.int32)
  if length % shards:
    raise ValueError(f"a sequence of {length} tokens does not split into {shards} equal parts")
  return np.arange(length, dtype=np.int32).reshape(shards, length // shards)


def layout_permutation(length: int, shards: int, balanced: bool) -> np.ndarray:
  """[length]: position p of the laid-out sequence holds original token `perm[p]`."""
  return global_positions(length, shards, balanced).reshape(-1)


def to_layout(batch: Mapping[str, jax.Array], shards: int, balanced: bool,
              length_axis: int = 1) -> dict[str, jax.Array]:
  """Every array of `batch` with its sequence dim (`length_axis`) put in the context layout.

  The identity when there is nothing to reorder (one shard, or the plain contiguous split).
  """
  if shards == 1 or not balanced:
    return dict(batch)
  out = {}
  for key, x in batch.items():
    perm = layout_permutation(x.shape[length_axis], shards, balanced)
    out[key] = jnp.take(x, perm, axis=length_axis)
  return out


def from_layout(x: jax.Array, shards: int, balanced: bool, length_axis: int = 1) -> jax.Array:
  """The inverse of `to_layout` for one array (e.g. logits returned to the caller's order)."""
  if shards == 1 or not balanced:
    return x
  perm = layout_permutation(x.shape[length_axis], shards, balanced)
  return jnp.take(x, np.argsort(perm), axis=length_axis)


def causal_pairs_per_device(length: int, shards: int, balanced: bool) -> np.ndarray:
  """[shards]: the (query, key) pairs each device must compute under causal attention, i.e. its
  attention FLOPs up to a constant. Equal entries mean a balanced load."""
  rows = global_positions(length, shards, balanced)
  return np.array([int(np.sum(row + 1)) for row in rows], dtype=np.int64)
