"""What the load-balanced context layout buys: attention work per device, with and without it.

For a sequence of T tokens split over C context devices, counts the (query tile, key tile) pairs
each device computes in causal attention: the tiles for which attention_tiles' own visibility
test (the `lax.cond` that skips tiles above the causal diagonal) is true, over every ring step
(the all_gather strategy computes the same tiles in one pass). Attention FLOPs per device are
that count times 4·t²·H·E forward (and 2.5x that again backward); the step waits for the busiest
device, so max/mean is the slowdown that imbalance costs in the attention share of the step.

  python benchmarks/context_balance.py [--tile 256] [--heads 32] [--head_dim 128]

The last line is `context_balance: T=N C=N plain_max_over_mean=X balanced_max_over_mean=X`
for the largest case.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.ops import attention_tiles as tiles
from jaxtrain.parallel.context_parallel import global_positions


def tiles_per_device(length: int, shards: int, balanced: bool, tile: int) -> np.ndarray:
  """[shards]: tiles each device computes, as decided by attention_tiles._visible."""
  rows = global_positions(length, shards, balanced)
  tile = tiles.fit_tile(tile, rows.shape[1])
  q_tiles = jnp.asarray(rows.reshape(shards, -1, tile))  # [C, Nq, t] original indices
  k_tiles = q_tiles.reshape(-1, tile)  # every part's key tiles, the whole sequence
  visible = jax.vmap(jax.vmap(lambda q, k: tiles._visible(q, k, True),  # pylint: disable=protected-access
                              in_axes=(None, 0)), in_axes=(0, None))
  counts = [int(jnp.sum(visible(q_tiles[i], k_tiles))) for i in range(shards)]
  return np.array(counts)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tile", type=int, default=tiles.DEFAULT_TILE)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--head_dim", type=int, default=128)
  args = parser.parse_args()
  cases = [(8192, 2), (8192, 4), (32768, 4), (32768, 8), (131072, 8), (131072, 16)]
  header = (f"{'T':>7} {'C':>3} {'layout':>9} {'tiles/device min..max':>22} "
            f"{'max/mean':>8} {'max fwd TFLOP/device':>20}")
  print(header)
  print("-" * len(header))
  last = None
  for length, shards in cases:
    ratios = {}
    for balanced in (False, True):
      counts = tiles_per_device(length, shards, balanced, args.tile)
      tile = tiles.fit_tile(args.tile, length // shards)
      flops = counts.max() * 4 * tile * tile * args.heads * args.head_dim
      ratios[balanced] = counts.max() / counts.mean()
      print(f"{length:>7} {shards:>3} {'balanced' if balanced else 'plain':>9} "
            f"{f'{counts.min()}..{counts.max()}':>22} {ratios[balanced]:>8.3f} "
            f"{flops / 1e12:>20.3f}")
    last = (length, shards, ratios)
  length, shards, ratios = last
  print(f"context_balance: T={length} C={shards} plain_max_over_mean={ratios[False]:.3f} "
        f"balanced_max_over_mean={ratios[True]:.3f}")


if __name__ == "__main__":
  main()
