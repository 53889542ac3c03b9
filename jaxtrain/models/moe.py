"""The Mixture-of-Experts feed-forward block: a router, experts as one grouped matmul, and the
router's losses and load figures.

Per token (N tokens, X experts, top k, shape letters as in layers.py plus A = N*k assignments,
C capacity per expert):

  router   logits_NX = x_ND @ router_DX in float32; probs = softmax(logits); the k largest
           probabilities pick the experts, renormalized to sum to 1 when `norm_topk_prob`.
  dispatch dropless (default): the N*k (token, expert) assignments sorted by expert, each
           expert's gated MLP applied to its rows by one grouped matmul per projection
           (jaxtrain/ops/grouped_matmul.py), unsorted, summed with the routing weights.
           capacity (`capacity_factor > 0`): each expert takes its first C assignments (every
           token's first choice before any second choice, then in token order) into an
           [X, C, D] buffer, one batched matmul per projection; assignments past C are dropped
           (that expert adds nothing for that token; the residual carries it).
  padding  (mask_N False) is never routed, on every route: its assignments sort after every
           real one, outside every group, buffer and all-to-all, and its output is 0. So
           padding takes no capacity (C counts the real tokens; the buffer is sized for all
           N) and the outputs, drops and statistics of the real tokens are the same whatever
           padding a batch holds and wherever it sits.
  losses   load-balancing (Switch / Mixtral form): X * sum_e f_e * P_e, f_e the share of
           assignments that chose expert e and P_e its mean router probability: 1.0 when
           balanced (transformers' Mixtral loss is k times this, over all layers at once).
           z-loss (ST-MoE): the mean of logsumexp(logits)^2.

The statistics are over the non-padding tokens of the whole batch, whatever the mesh: the
expert-parallel path (parallel/expert_parallel.py) runs `moe_ffn` on each device's tokens and
sums the statistics over the devices, so one device and eight give the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.ops import fp8
from jaxtrain.ops.grouped_matmul import grouped_matmul
from jaxtrain.parallel import expert_parallel
from jaxtrain.parallel.expert_parallel import Sequences

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


@dataclasses.dataclass(frozen=True)
class Routing:
  """What the MoE computation needs besides the weights (hashable: a static module attribute)."""
  num_experts: int
  top_k: int
  norm_topk_prob: bool
  capacity_factor: float
  activation: str
  matmul_impl: str  # "ragged" | "blocked" (resolved)
  dtype: str
  lora_scale: float = 0.0  # alpha / rank of the experts' adapters, when they have them
  # DeepSeek-V3's router (`route`): sigmoid scores, group-limited choice, scaled weights.
  score: str = "softmax"
  n_group: int = 1
  topk_group: int = 1
  scaling_factor: float = 1.0
  # DeepSeek-V3's sequence-wise balance statistics (moe.seq_aux_loss_coef > 0).
  sequence_balance: bool = False
  # The experts' base matmuls: "none" or "fp8" (precision.matmul; every route).
  precision: str = "none"


# The experts' weights travel as a dict: "gate", "up" [X, D, F] and "down" [X, F, D], and for
# each with LoRA adapters "<name>_a" [X, I, R] and "<name>_b" [X, R, O] (WEIGHT_NAMES below:
# their logical axes).


def route(logits_NX: jax.Array, routing: Routing, bias_X: jax.Array | None = None,
          forced_NK: jax.Array | None = None):
  """(probs_NX, weights_NK, experts_NK) from float32 router logits: each token's scores over
  the experts (summing to 1: the softmax, or the sigmoid scores normalized, for the balance
  loss), the top-k's routing weights and expert indices.

  `forced_NK`: the experts to use instead of the top-k (routing replay: the ones a rollout's
  forward pass chose), where >= 0; a token whose entries are -1 (nothing recorded) chooses its
  own. The weights are still the router's for the experts used, as below, so the router trains
  through them.

  softmax (Mixtral, Qwen3-MoE): the k most probable experts, weighted by their probabilities,
  renormalized to sum to 1 when `norm_topk_prob`.
  sigmoid (DeepSeek-V3): scores sigmoid(logits); the choice ranks score + bias_X (the
  correction bias: it steers which experts are chosen, never their weights), among the experts
  of the `topk_group` of `n_group` groups whose two best biased scores sum highest; weights are
  the chosen experts' scores, renormalized when `norm_topk_prob`, times `scaling_factor`.
  """
  logits_NX = logits_NX.astype(jnp.float32)
  if routing.score == "softmax":
    probs_NX = jax.nn.softmax(logits_NX, axis=-1)
    choice_NX = probs_NX
  else:
    scores_NX = jax.nn.sigmoid(logits_NX)
    probs_NX = scores_NX / jnp.sum(scores_NX, axis=-1, keepdims=True)
    choice_NX = scores_NX if bias_X is None else scores_NX + bias_X.astype(jnp.float32)
  if routing.n_group > 1:
    choice_NX = _within_best_groups(choice_NX, routing.n_group, routing.topk_group)
  _, experts_NK = jax.lax.top_k(choice_NX, routing.top_k)
  if forced_NK is not None:
    experts_NK = jnp.where(forced_NK >= 0, forced_NK.astype(experts_NK.dtype), experts_NK)
  source_NX = probs_NX if routing.score == "softmax" else scores_NX
  weights_NK = jnp.take_along_axis(source_NX, experts_NK, axis=-1)
  if routing.norm_topk_prob:
    weights_NK = weights_NK / (jnp.sum(weights_NK, axis=-1, keepdims=True) + 1e-20)
  if routing.scaling_factor != 1.0:
    weights_NK = weights_NK * routing.scaling_factor
  return probs_NX, weights_NK, experts_NK.astype(jnp.int32)


def _within_best_groups(choice_NX, n_group: int, topk_group: int):
  """choice_NX with the experts outside each token's `topk_group` best groups set to 0 (as
  DeepSeek-V3's reference does): a group's rank is the sum of its two best choice scores."""
  n, x = choice_NX.shape
  grouped_NGM = choice_NX.reshape(n, n_group, x // n_group)
  group_score_NG = jnp.sum(jax.lax.top_k(grouped_NGM, min(2, x // n_group))[0], axis=-1)
  _, best_NJ = jax.lax.top_k(group_score_NG, topk_group)
  keep_NG = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], best_NJ].set(True)
  return jnp.where(keep_NG[:, :, None], grouped_NGM, 0.0).reshape(n, x)


def capacity(assignments, routing: Routing):
  """Assignments each expert takes per device in capacity mode: ceil(cf * A / X) (at least 1),
  A = N * k. An int A gives the buffer's static size (every position); a traced one the limit
  (the real tokens' assignments). Both round the same float32 product, so the two agree
  exactly when no token is padding."""
  per_assignment = np.float32(routing.capacity_factor / routing.num_experts)
  if isinstance(assignments, int):
    return max(1, int(np.ceil(np.float32(assignments) * per_assignment)))
  return jnp.maximum(1, jnp.ceil(assignments.astype(jnp.float32) * per_assignment)
                     ).astype(jnp.int32)


def sort_by_expert(experts_NK: jax.Array, num_experts: int, mask_N: jax.Array | None = None):
  """The assignments in expert order. Assignment a = j * N + n is token n's j-th choice (so
  every first choice precedes any second choice within an expert's rows). Padding's
  assignments (mask_N False) get expert X: they sort after every real row, in no group.

  Returns (order_A: assignment indices sorted by expert, stable; token_A: the token of each
  sorted row; expert_A: its expert, X for padding; group_sizes_X: the real rows only)."""
  n, k = experts_NK.shape
  if mask_N is not None:
    experts_NK = jnp.where(mask_N[:, None], experts_NK, num_experts)
  experts_A = experts_NK.T.reshape(n * k)
  order_A = jnp.argsort(experts_A, stable=True)
  token_A = (order_A % n).astype(jnp.int32)
  group_sizes_X = jnp.zeros((num_experts,), jnp.int32).at[experts_A].add(1, mode="drop")
  return order_A, token_A, experts_A[order_A], group_sizes_X


def inverse_permutation(order: jax.Array) -> jax.Array:
  """inv with inv[order[i]] = i: unsorting by a gather (y[inv]) rather than a scatter, which
  XLA:GPU runs far slower and, for bfloat16, through 32-bit copies of the whole buffer."""
  return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                             unique_indices=True)


def unsort_and_combine(y_AD: jax.Array, order_A: jax.Array, weights_NK: jax.Array) -> jax.Array:
  """Rows in expert order back to [k, N] assignment order, summed per token with the routing
  weights (float32): out_ND."""
  n, k = weights_NK.shape
  y_AD = y_AD[inverse_permutation(order_A)]
  y_KND = y_AD.reshape(k, n, -1).astype(jnp.float32)
  return jnp.einsum("KND,NK->ND", y_KND, weights_NK)


def expert_mlp_grouped(x_RD, group_sizes_G, experts: dict, routing: Routing):
  """Each group's rows through its expert's gated MLP: three grouped matmuls (and two more per
  projection with adapters, through the rank-R factors)."""
  def mm(x, name):
    y = grouped_matmul(x, experts[name], group_sizes_G, impl=routing.matmul_impl,
                       precision=routing.precision)
    if name + "_a" in experts:
      h = grouped_matmul(x, experts[name + "_a"], group_sizes_G, impl=routing.matmul_impl)
      y = y + grouped_matmul(h * routing.lora_scale, experts[name + "_b"], group_sizes_G,
                             impl=routing.matmul_impl)
    return y
  act = _ACTIVATIONS[routing.activation]
  return mm(act(mm(x_RD, "gate")) * mm(x_RD, "up"), "down")


def expert_mlp_batched(x_GCD, experts: dict, routing: Routing):
  """Each expert's C buffered rows through its gated MLP: three batched matmuls (and the
  adapters' factors)."""
  def mm(x, name):
    if routing.precision == "fp8":
      y = fp8.batched_matmul(x, experts[name], x.dtype)
    else:
      y = jnp.einsum("GCI,GIO->GCO", x, experts[name], preferred_element_type=jnp.float32)
    if name + "_a" in experts:
      h = jnp.einsum("GCI,GIR->GCR", x, experts[name + "_a"]) * routing.lora_scale
      y = y + jnp.einsum("GCR,GRO->GCO", h, experts[name + "_b"],
                         preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
  act = _ACTIVATIONS[routing.activation]
  return mm(act(mm(x_GCD, "gate")) * mm(x_GCD, "up"), "down")


def capacity_slots(expert_A, group_sizes_X, routing: Routing, tokens: int):
  """(the buffer's rows C, each sorted row's slot in its expert's [C] rows, whether the row
  was dropped) for `tokens` positions: an expert takes its first `capacity` real rows, counted
  over the real tokens (group_sizes_X); a row it does not take, dropped or padding (expert X),
  gets slot C, outside the buffer, so scatters skip it and gathers give 0."""
  cap = capacity(tokens * routing.top_k, routing)
  limit = capacity(jnp.sum(group_sizes_X), routing)  # <= cap: real rows <= positions * k
  starts_X = jnp.cumsum(group_sizes_X) - group_sizes_X
  slot_A = (jnp.arange(expert_A.shape[0], dtype=jnp.int32)
            - jnp.take(starts_X, expert_A, mode="clip"))
  real_A = expert_A < routing.num_experts
  kept_A = real_A & (slot_A < limit)
  return cap, jnp.where(kept_A, slot_A, cap), real_A & ~kept_A


def router_stats(logits_NX, probs_NX, experts_NK, mask_N, dropped_A, psum,
                 sequences: Sequences | None = None):
  """The layer's statistics over the non-padding tokens; `psum` sums over the devices that
  hold other tokens (identity on one device). With `sequences`, also the sequence-wise balance
  loss's sum over the batch's rows and their count (`sequence_balance`)."""
  n, x = probs_NX.shape
  k = experts_NK.shape[1]
  mask_N = mask_N.astype(jnp.float32)
  one_hot_NKX = jax.nn.one_hot(experts_NK, x, dtype=jnp.float32)
  load_X, prob_sum_X, tokens, z_sum, dropped = psum((
      jnp.einsum("NKX,N->X", one_hot_NKX, mask_N),
      jnp.einsum("NX,N->X", probs_NX, mask_N),
      jnp.sum(mask_N),
      jnp.sum(jnp.square(jax.nn.logsumexp(logits_NX, axis=-1)) * mask_N),
      jnp.sum(dropped_A.reshape(k, n).astype(jnp.float32) * mask_N[None, :])))
  tokens = jnp.maximum(tokens, 1.0)
  assignments = tokens * k
  stats = {
      "aux_loss": x * jnp.sum((load_X / assignments) * (prob_sum_X / tokens)),
      "z_loss": z_sum / tokens,
      "max_load": jnp.max(load_X) / jnp.maximum(jnp.mean(load_X), 1e-9),
      "dropped": dropped,
      "assignments": assignments,
      "expert_load": load_X,
  }
  if sequences is not None:
    loss_sum, rows = sequence_balance(probs_NX, one_hot_NKX, mask_N, sequences)
    # Every device holding part of a row computed its whole-row term: count it once.
    stats["seq_aux_sum"], stats["sequences"] = jax.tree.map(
        lambda v: v / sequences.shards, psum((loss_sum, rows)))
  return stats


def sequence_balance(probs_NX, one_hot_NKX, mask_N, sequences: Sequences):
  """(sum over this device's rows of the sequence-wise balance loss, rows with tokens): per row
  (a packed row counts as one sequence), X/k * sum_e f_e * P_e with f_e the count of the row's
  assignments to expert e over its tokens and P_e the mean of e's normalized score over them
  (DeepSeek-V3's L_Bal, before its coefficient)."""
  _, x = probs_NX.shape
  k = one_hot_NKX.shape[1]
  mask_bT = mask_N.reshape(sequences.rows, -1)
  counts_bX, score_bX, tokens_b = sequences.psum((
      jnp.einsum("bTKX,bT->bX", one_hot_NKX.reshape(sequences.rows, -1, k, x), mask_bT),
      jnp.einsum("bTX,bT->bX", probs_NX.reshape(sequences.rows, -1, x), mask_bT),
      jnp.sum(mask_bT, axis=-1)))
  per_token_b = 1.0 / jnp.maximum(tokens_b, 1.0)
  loss_b = (x / k) * jnp.sum(counts_bX * score_bX, axis=-1) * jnp.square(per_token_b)
  return jnp.sum(loss_b), jnp.sum((tokens_b > 0).astype(jnp.float32))


def local_experts(experts: dict, routing: Routing, tokens: int):
  """The dispatch when this device holds every expert: `run(x_AD, expert_A, group_sizes_X)
  -> (y_AD, dropped_A)` on the assignments in expert order (padding last, expert X: the
  grouped matmul leaves rows past the groups 0)."""
  def run(x_AD, expert_A, group_sizes_X):
    if routing.capacity_factor <= 0:
      y_AD = expert_mlp_grouped(x_AD, group_sizes_X, experts, routing)
      return y_AD, jnp.zeros(expert_A.shape, bool)
    cap, slot_A, dropped_A = capacity_slots(expert_A, group_sizes_X, routing, tokens)
    buffer_XCD = jnp.zeros((routing.num_experts, cap, x_AD.shape[1]), x_AD.dtype)
    buffer_XCD = buffer_XCD.at[expert_A, slot_A].set(x_AD, mode="drop")
    y_XCD = expert_mlp_batched(buffer_XCD, experts, routing)
    return y_XCD.at[expert_A, slot_A].get(mode="fill", fill_value=0), dropped_A
  return run


def moe_ffn(x_ND, mask_N, router: dict, run, routing: Routing, *, psum=lambda t: t,
            sequences: Sequences = Sequences(), forced_NK=None):
  """One device's N tokens through the MoE block: (out_ND in float32, statistics, the chosen
  experts [N, k] int32).

  `run(x_AD, expert_A, group_sizes_X) -> (y_AD, dropped_A)` takes the assignments, sorted by
  expert, through their experts (`local_experts`, or `exchanging_experts`); `psum` sums the
  statistics over the devices holding other tokens; `sequences`: how the tokens form rows;
  `forced_NK`: experts to replay instead of choosing (`route`). Padding (mask_N False) is not
  routed (module docstring): its output is 0 and it enters no statistic."""
  logits_NX = jnp.dot(x_ND.astype(jnp.float32), router["weight"].astype(jnp.float32))
  probs_NX, weights_NK, experts_NK = route(logits_NX, routing, router.get("bias"), forced_NK)
  order_A, token_A, expert_A, group_sizes_X = sort_by_expert(experts_NK, routing.num_experts,
                                                             mask_N)
  y_AD, dropped_sorted_A = run(x_ND[token_A], expert_A, group_sizes_X)
  # Zero weights make padding's output 0 (and its router gradient) on every route.
  out_ND = unsort_and_combine(y_AD, order_A, jnp.where(mask_N[:, None], weights_NK, 0.0))
  dropped_A = dropped_sorted_A[inverse_permutation(order_A)]
  return out_ND, router_stats(logits_NX, probs_NX, experts_NK, mask_N, dropped_A, psum,
                              sequences if routing.sequence_balance else None), experts_NK


def exchanging_experts(experts: dict, routing: Routing, tokens: int, shards: int):
  """The dispatch when this device holds G = X/E of the experts (mesh.expert = E): the
  assignments travel to their experts' shards and back by all-to-all; `run(x_AD, expert_A,
  group_sizes_X) -> (y_AD, dropped_A)` as for `local_experts`.

  Dropless, a device may send all of its A = N*k assignments to one peer, so each per-peer
  buffer holds A rows (exact; the receiver computes only the rows present). In capacity mode
  each device sends each expert at most C rows: [X, C, D] buffers. Padding rows (expert X,
  sorted last, in no group) are sent nowhere and come back 0."""
  local = routing.num_experts // shards
  all_to_all = expert_parallel.all_to_all

  def dropless(x_AD, expert_A, group_sizes_X):
    a, d = x_AD.shape
    shard_A = expert_A // local
    per_shard_S = group_sizes_X.reshape(shards, local).sum(axis=1)
    start_S = jnp.cumsum(per_shard_S) - per_shard_S
    pos_A = jnp.arange(a, dtype=jnp.int32) - start_S[shard_A]
    # Slot p of the buffer for shard s is sorted row start_S[s] + p while p < per_shard_S[s]
    # (the rows are sorted by expert, so by shard): the buffer is a gather, not a scatter.
    slot_P = jnp.arange(a, dtype=jnp.int32)
    used_SP = slot_P[None, :] < per_shard_S[:, None]
    row_SP = jnp.minimum(start_S[:, None] + slot_P[None, :], a - 1)
    send_SPD = jnp.where(used_SP[..., None], x_AD[row_SP], 0).astype(x_AD.dtype)
    # Each row's expert on the receiving shard; `local` marks an empty row.
    ids_SP = jnp.where(used_SP, expert_A[row_SP] % local, local)
    recv_RD, ids_R = all_to_all(send_SPD).reshape(shards * a, d), all_to_all(ids_SP).ravel()
    order_R = jnp.argsort(ids_R, stable=True)  # empty rows last, outside every group
    sizes_G = jnp.zeros((local,), jnp.int32).at[ids_R].add(1, mode="drop")
    y_RD = expert_mlp_grouped(recv_RD[order_R], sizes_G, experts, routing)
    back_SPD = all_to_all(y_RD[inverse_permutation(order_R)].reshape(shards, a, d))
    # Padding's shard_A is `shards`, past the buffers: the fill gives it 0.
    return back_SPD.at[shard_A, pos_A].get(mode="fill", fill_value=0), jnp.zeros((a,), bool)

  def capacity_bounded(x_AD, expert_A, group_sizes_X):
    d = x_AD.shape[1]
    cap, slot_A, dropped_A = capacity_slots(expert_A, group_sizes_X, routing, tokens)
    send_XCD = jnp.zeros((routing.num_experts, cap, d), x_AD.dtype)
    send_XCD = send_XCD.at[expert_A, slot_A].set(x_AD, mode="drop")
    recv_SGCD = all_to_all(send_XCD.reshape(shards, local, cap, d))
    x_GRD = recv_SGCD.transpose(1, 0, 2, 3).reshape(local, shards * cap, d)
    y_GRD = expert_mlp_batched(x_GRD, experts, routing)
    y_SGCD = y_GRD.reshape(local, shards, cap, d).transpose(1, 0, 2, 3)
    y_XCD = all_to_all(y_SGCD).reshape(routing.num_experts, cap, d)
    return y_XCD.at[expert_A, slot_A].get(mode="fill", fill_value=0), dropped_A

  return capacity_bounded if routing.capacity_factor > 0 else dropless


def moe_layer(x_BTD, mask_BT, router: dict, experts: dict, routing: Routing, forced_BTK=None):
  """The MoE block on [B, T, D] tokens, under the current mesh (or none): (out_BTD in x's dtype,
  the layer's router statistics, the chosen experts [B, T, k] int32). `router`: {"weight":
  [D, X]} and, for DeepSeek's router, its correction {"bias": [X]}; `experts`: the weights
  (gate, up, down, and adapters: keys of WEIGHT_NAMES) in the compute dtype; `forced_BTK`:
  experts to replay instead of choosing them (`route`). Under a mesh each device routes its own
  tokens (parallel/expert_parallel.over_token_shards), exchanging them with the devices that
  hold their experts when mesh.expert > 1."""
  def body(x_ND, mask_N, router, experts, psum, shards, sequences, forced_NK):
    n = x_ND.shape[0]
    if shards == 1:
      run = local_experts(experts, routing, n)
    else:
      run = exchanging_experts(experts, routing, n, shards)
    return moe_ffn(x_ND, mask_N, router, run, routing, psum=psum, sequences=sequences,
                   forced_NK=forced_NK)

  if jax.sharding.get_abstract_mesh().empty:
    b, t, d = x_BTD.shape
    forced_NK = None if forced_BTK is None else forced_BTK.reshape(b * t, -1)
    out_ND, stats, experts_NK = body(x_BTD.reshape(b * t, d), mask_BT.reshape(b * t), router,
                                     experts, lambda tree: tree, 1, Sequences(rows=b),
                                     forced_NK)
    return out_ND.reshape(b, t, d).astype(x_BTD.dtype), stats, experts_NK.reshape(b, t, -1)
  return expert_parallel.over_token_shards(body, x_BTD, mask_BT, router, experts,
                                           {k: WEIGHT_NAMES[k] for k in experts}, forced_BTK)


# Logical axes of the expert weights (mesh.LOGICAL_RULES), and of their adapters' factors.
WEIGHT_NAMES = {
    "gate": ("experts", "expert_embed", "expert_mlp"),
    "up": ("experts", "expert_embed", "expert_mlp"),
    "down": ("experts", "expert_mlp", "expert_embed"),
}
for _name, (_x, _i, _o) in list(WEIGHT_NAMES.items()):
  WEIGHT_NAMES[_name + "_a"] = (_x, _i, "lora_rank")
  WEIGHT_NAMES[_name + "_b"] = (_x, "lora_rank", _o)


# The router statistics of the forward passes traced inside `collect_router_stats()`: the
# decoder reports each pass's (stacked over its MoE layers); the objective that opened the
# collection turns them into losses and metrics in the same trace.
_COLLECTIONS: list[list[dict]] = []


@contextlib.contextmanager
def collect_router_stats():
  """Collects the router statistics of the MoE forward passes traced inside the block: a list,
  one dict per pass (nothing for a dense model)."""
  collected: list[dict] = []
  _COLLECTIONS.append(collected)
  try:
    yield collected
  finally:
    _COLLECTIONS.pop()


def report_router_stats(stats: dict) -> None:
  """Hands a forward pass's statistics to the innermost open collection (if any)."""
  if _COLLECTIONS:
    _COLLECTIONS[-1].append(stats)


# What the objectives report per step from the router statistics (train_step; metrics.jsonl).
METRIC_NAMES = ("moe_aux_loss", "moe_z_loss", "moe_max_load", "moe_dropped_fraction",
                "moe_seq_aux_loss")
# The training objectives hand each MoE layer's expert loads [L_moe, X] to the train step under
# this key, for the bias balancing (`balance_router_biases`); the step takes it out of the
# metrics before they are logged.
EXPERT_LOAD = "moe_expert_load"


def objective_terms(passes: list[dict], aux_loss_coef: float, z_loss_coef: float,
                    capacity_mode: bool, seq_aux_loss_coef: float = 0.0):
  """(what the router adds to the loss, {metric: value}) from the MoE layers' statistics of
  the collected forward passes (each stacked [L_moe, ...]): the aux, z and (when collected)
  sequence-wise balance losses averaged over the layers and weighted; the busiest expert's load
  over the mean, the maximum over layers; in capacity mode the share of assignments dropped."""
  stats = jax.tree.map(lambda *s: jnp.concatenate(s), *passes)
  aux, z = jnp.mean(stats["aux_loss"]), jnp.mean(stats["z_loss"])
  metrics = {"moe_aux_loss": aux, "moe_z_loss": z, "moe_max_load": jnp.max(stats["max_load"])}
  extra = aux_loss_coef * aux + z_loss_coef * z
  if capacity_mode:
    metrics["moe_dropped_fraction"] = (jnp.sum(stats["dropped"])
                                       / jnp.maximum(jnp.sum(stats["assignments"]), 1.0))
  if "seq_aux_sum" in stats:
    seq = jnp.mean(stats["seq_aux_sum"] / jnp.maximum(stats["sequences"], 1.0))
    metrics["moe_seq_aux_loss"] = seq
    extra = extra + seq_aux_loss_coef * seq
  return extra, metrics


def expert_load(passes: list[dict]) -> jax.Array:
  """Assignments per expert of each MoE layer [L_moe, X], summed over the collected passes."""
  return sum(p["expert_load"] for p in passes)


def is_router_bias(path) -> bool:
  """Whether a params tree path (jax.tree_util's) leads to a router correction bias."""
  return any(getattr(k, "key", getattr(k, "name", None)) == "router_bias_X" for k in path)


def balance_router_biases(params, load_LX: jax.Array, rate: float):
  """`params` with each MoE layer's router correction bias (DeepSeek-V3's auxiliary-loss-free
  balancing) moved by `rate` against its expert's load error: down for experts that took more
  than the layer's mean load, up for those that took less (sign only, as in the paper).

  The bias leaves are found by name (`router_bias_X`) in tree order, which is layer order (a
  scanned stack [L, X], or one [X] per listed layer), matching the statistics' rows."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  is_bias = [is_router_bias(path) for path, _ in leaves]
  rows = sum(leaf.shape[0] if leaf.ndim == 2 else 1
             for (_, leaf), bias in zip(leaves, is_bias) if bias)
  if rows != load_LX.shape[0]:
    raise ValueError(f"{rows} router bias rows for {load_LX.shape[0]} MoE layers' loads")
  error_LX = jnp.mean(load_LX, axis=-1, keepdims=True) - load_LX
  step_LX = rate * jnp.sign(error_LX)
  out, row = [], 0
  for (_, leaf), bias in zip(leaves, is_bias):
    if bias:
      n = leaf.shape[0] if leaf.ndim == 2 else 1
      leaf = leaf + step_LX[row:row + n].reshape(leaf.shape).astype(leaf.dtype)
      row += n
    out.append(leaf)
  return jax.tree_util.tree_unflatten(treedef, out)
