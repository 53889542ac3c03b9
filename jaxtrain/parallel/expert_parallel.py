"""Expert parallelism: what the sharding rules cannot say about an MoE layer.

The rules (mesh.LOGICAL_RULES) split the experts' weights [X, D, F] over the `expert` axis (and
F over `tensor`); the tokens are split over the batch axes, `expert` among them. A token's
experts may live on another device, so the MoE layer runs inside `shard_map` over the whole
mesh, each device routing its own tokens (models/moe.moe_ffn):

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

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.models.moe import (Routing, capacity, capacity_slots, expert_mlp_batched,
                                 expert_mlp_grouped, local_experts, moe_ffn)
from jaxtrain.parallel.mesh import BATCH_AXES, axis_size

EXPERT_AXIS = "expert"


def moe_layer(x_BTD, mask_BT, router_DX, w_gate_XDF, w_up_XDF, w_down_XFD, routing: Routing):
  """The MoE block on [B, T, D] tokens, under the current mesh (or none): (out_BTD in x's dtype,
  the layer's router statistics)."""
  b, t, d = x_BTD.shape
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    experts = local_experts(w_gate_XDF, w_up_XDF, w_down_XFD, routing, b * t)
    out_ND, stats = moe_ffn(x_BTD.reshape(b * t, d), mask_BT.reshape(b * t), router_DX,
                            experts, routing)
    return out_ND.reshape(b, t, d).astype(x_BTD.dtype), stats
  token_axes = tuple(a for a in BATCH_AXES + ("context",) if a in mesh.axis_names)
  shards = axis_size(EXPERT_AXIS, mesh)

  def body(x_btD, mask_bt, router_DX, w_gate, w_up, w_down):
    bl, tl, _ = x_btD.shape
    n = bl * tl
    if shards == 1:
      experts = local_experts(w_gate, w_up, w_down, routing, n)
    else:
      experts = _exchanging_experts(w_gate, w_up, w_down, routing, n, shards)
    out_ND, stats = moe_ffn(x_btD.reshape(n, d), mask_bt.reshape(n), router_DX, experts,
                            routing, psum=lambda tree: jax.lax.psum(tree, token_axes))
    out_ND = jax.lax.psum(out_ND, "tensor")  # each tensor shard computed its F slice
    return out_ND.reshape(bl, tl, d).astype(x_btD.dtype), stats

  tokens = P(BATCH_AXES, "context", None)
  up, down = P(EXPERT_AXIS, None, "tensor"), P(EXPERT_AXIS, "tensor", None)
  return jax.shard_map(
      body, mesh=mesh,
      in_specs=(tokens, P(BATCH_AXES, "context"), P(), up, up, down),
      out_specs=(tokens, P()))(x_BTD, mask_BT, router_DX, w_gate_XDF, w_up_XDF, w_down_XFD)


def _all_to_all(x):
  """Block i of the leading axis goes to expert-shard i; blocks received stack in source order."""
  return jax.lax.all_to_all(x, EXPERT_AXIS, split_axis=0, concat_axis=0, tiled=True)


def _exchanging_experts(w_gate_GDF, w_up_GDF, w_down_GFD, routing: Routing, tokens: int,
                        shards: int):
  """The dispatch when this device holds G = X/E experts: assignments travel to their
  experts' shards and back by all-to-all (`experts(x_AD, expert_A, group_sizes_X)`)."""
  local = routing.num_experts // shards

  def dropless(x_AD, expert_A, group_sizes_X):
    a, d = x_AD.shape
    shard_A, local_A = expert_A // local, expert_A % local
    per_shard_S = group_sizes_X.reshape(shards, local).sum(axis=1)
    pos_A = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(per_shard_S) - per_shard_S)[shard_A]
    send_SAD = jnp.zeros((shards, a, d), x_AD.dtype).at[shard_A, pos_A].set(x_AD)
    # Each row's expert on the receiving shard; `local` marks an empty row.
    ids_SA = jnp.full((shards, a), local, jnp.int32).at[shard_A, pos_A].set(local_A)
    recv_RD, ids_R = _all_to_all(send_SAD).reshape(shards * a, d), _all_to_all(ids_SA).ravel()
    order_R = jnp.argsort(ids_R, stable=True)  # empty rows last, outside every group
    sizes_G = jnp.zeros((local,), jnp.int32).at[ids_R].add(1, mode="drop")
    y_RD = expert_mlp_grouped(recv_RD[order_R], sizes_G, w_gate_GDF, w_up_GDF, w_down_GFD,
                              routing)
    y_RD = jnp.zeros_like(y_RD).at[order_R].set(y_RD, unique_indices=True)
    back_SAD = _all_to_all(y_RD.reshape(shards, a, d))
    return back_SAD[shard_A, pos_A], jnp.zeros((a,), bool)

  def capacity_bounded(x_AD, expert_A, group_sizes_X):
    d = x_AD.shape[1]
    cap = capacity(tokens, routing)
    slot_A, kept_A = capacity_slots(expert_A, group_sizes_X, cap)
    send_XCD = jnp.zeros((routing.num_experts, cap, d), x_AD.dtype)
    send_XCD = send_XCD.at[expert_A, slot_A].set(x_AD, mode="drop")
    recv_SGCD = _all_to_all(send_XCD.reshape(shards, local, cap, d))
    x_GRD = recv_SGCD.transpose(1, 0, 2, 3).reshape(local, shards * cap, d)
    y_GRD = expert_mlp_batched(x_GRD, w_gate_GDF, w_up_GDF, w_down_GFD, routing)
    y_SGCD = y_GRD.reshape(local, shards, cap, d).transpose(1, 0, 2, 3)
    y_XCD = _all_to_all(y_SGCD).reshape(routing.num_experts, cap, d)
    return y_XCD.at[expert_A, slot_A].get(mode="fill", fill_value=0), ~kept_A

  return capacity_bounded if routing.capacity_factor > 0 else dropless
