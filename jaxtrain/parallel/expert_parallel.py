"""Expert parallelism: what the sharding rules cannot say about an MoE layer.

The rules (mesh.LOGICAL_RULES) split the experts' weights [X, D, F] over the `expert` axis (and
F over `tensor`); the tokens are split over the batch axes, `expert` among them. A token's
experts may live on another device, so the MoE layer runs inside `shard_map` over the whole
mesh, each device routing its own tokens (`over_token_shards`; the dispatch itself, which
calls `all_to_all`, is models/moe.py's):

- mesh.expert = 1: each device holds every expert (the weights gathered along fsdp as FSDP
  does); its assignments go through the grouped matmul locally.
- mesh.expert = E > 1: each device holds X/E experts. Its assignments, sorted by expert, are
  already grouped by the device that holds their expert; an `all_to_all` over `expert` sends
  each group there, the receiver runs what it got through its experts, and a second
  `all_to_all` brings the results back to the tokens' devices.
  Dropless, a device may send all of its N*k assignments to one peer, so each per-peer buffer
  holds N*k rows (exact, and E times the rows any one device computes on; the grouped matmul
  only computes the rows present). In capacity mode each device sends each expert at most C
  rows: buffers of [X, C, D], the classic capacity-bounded all-to-all.

Under tensor parallelism each device computes its F slice of every expert, and the outputs are
summed over `tensor` at the end. The router's statistics are summed over the devices holding
other tokens, so they are the whole batch's on every device.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel.mesh import BATCH_AXES, axis_size, gathered_spec

EXPERT_AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class Sequences:
  """How a device's N tokens form rows of the batch, for the router's sequence-wise statistics
  (models/moe.sequence_balance): `rows` rows of N/rows tokens each; `psum` sums over the
  devices holding the rest of the same rows (the `context` axis), `shards` of them."""
  rows: int = 1
  psum: Callable = lambda tree: tree
  shards: int = 1


def all_to_all(x):
  """Block i of the leading axis goes to expert-shard i; blocks received stack in source order."""
  return jax.lax.all_to_all(x, EXPERT_AXIS, split_axis=0, concat_axis=0, tiled=True)


def over_token_shards(body: Callable, x_BTD, mask_BT, router: dict, experts: dict,
                      expert_names: dict, forced_BTK=None):
  """`body(x_ND, mask_N, router, experts, psum, expert_shards, sequences, forced_NK)` on each
  device's tokens under the current mesh, inside shard_map: x_ND and mask_N this device's tokens
  (flattened), the router's arrays whole, `experts` ({name: array}, logical axes in
  `expert_names`) this device's slices: split over `expert` and over `tensor` where their names
  say so, FSDP's shards gathered on the way in (mesh.gathered_spec). `psum(tree)` sums over the
  devices holding other tokens; `expert_shards` is E; `sequences` (Sequences above): this
  device's rows and the sum over the `context` devices that hold the rest of them; `forced_NK`
  this device's rows of `forced_BTK` (experts to replay; None without). `body` returns (out_ND
  float32, statistics, chosen experts [N, k]); the partial outputs of the tensor shards are
  summed here. Returns (out_BTD in x's dtype, statistics, chosen experts [B, T, k])."""
  b, t, d = x_BTD.shape
  mesh = jax.sharding.get_abstract_mesh()
  token_axes = tuple(a for a in BATCH_AXES + ("context",) if a in mesh.axis_names)
  shards = axis_size(EXPERT_AXIS, mesh)
  context = axis_size("context", mesh)

  def per_device(x_btD, mask_bt, router, experts, forced_btK):
    bl, tl, _ = x_btD.shape
    sequences = Sequences(rows=bl, shards=context, psum=(
        (lambda tree: jax.lax.psum(tree, "context")) if context > 1 else (lambda tree: tree)))
    forced_NK = None if forced_btK is None else forced_btK.reshape(bl * tl, -1)
    out_ND, stats, experts_NK = body(x_btD.reshape(bl * tl, d), mask_bt.reshape(bl * tl),
                                     router, experts,
                                     lambda tree: jax.lax.psum(tree, token_axes), shards,
                                     sequences, forced_NK)
    out_ND = jax.lax.psum(out_ND, "tensor")  # each tensor shard computed its F slice
    return (out_ND.reshape(bl, tl, d).astype(x_btD.dtype), stats,
            experts_NK.reshape(bl, tl, -1))

  tokens = P(BATCH_AXES, "context", None)
  expert_specs = {k: gathered_spec(expert_names[k]) for k in experts}
  return jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(tokens, P(BATCH_AXES, "context"), P(), expert_specs, tokens),
      out_specs=(tokens, P(), tokens))(x_BTD, mask_BT, router, experts, forced_BTK)
