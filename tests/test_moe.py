"""The Mixture-of-Experts block (models/moe.py, parallel/expert_parallel.py) and its grouped
matmul (grouped_matmul.py) against per-token numpy references, across meshes; its config checks
and its parameter counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxtrain.models import cost
from jaxtrain.models.config import Architecture
from jaxtrain.models.moe import Routing, moe_layer
from jaxtrain.ops.grouped_matmul import grouped_matmul
from jaxtrain.parallel.mesh import logical_to_spec
from tests.helpers import assert_one_line_config_error, mesh_of, small_config
from tests.moe_helpers import with_changes

X, D, F, B, T, K = 8, 16, 24, 8, 12, 2


# --- grouped matmul ---------------------------------------------------------------------------


def _grouped_reference(x, w, sizes):
  rows = np.repeat(np.arange(len(sizes)), sizes)
  out = np.zeros((x.shape[0], w.shape[-1]), np.float64)
  for r, g in enumerate(rows):
    out[r] = x[r].astype(np.float64) @ w[g]
  return out


@pytest.mark.parametrize("impl", ["blocked", "ragged"])
@pytest.mark.parametrize("rows,sizes,block", [
    (100, [30, 0, 45, 25], 8),  # an empty group, groups across block boundaries
    (100, [10, 20, 0, 47], 16),  # rows past the groups' total come out zero
    (37, [0, 0, 30, 0, 7], 128),  # blocks larger than the rows
    (64, [0, 0, 0], 8),  # no rows in any group
])
def test_grouped_matmul_matches_per_row_products_and_their_gradients(impl, rows, sizes, block):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(rows, D)).astype(np.float32)
  w = rng.normal(size=(len(sizes), D, F)).astype(np.float32)
  dy = rng.normal(size=(rows, F)).astype(np.float32)
  sizes = np.asarray(sizes, np.int32)
  f = jax.jit(lambda x, w: grouped_matmul(x, w, sizes, impl=impl, block_rows=block))
  want = _grouped_reference(x, w, sizes)
  np.testing.assert_allclose(f(x, w), want, atol=2e-5, rtol=1e-5)
  gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * dy), argnums=(0, 1)))(x, w)
  in_groups = np.arange(rows) < sizes.sum()
  want_gx = np.zeros_like(x)
  want_gw = np.zeros_like(w, dtype=np.float64)
  for r, g in enumerate(np.repeat(np.arange(len(sizes)), sizes)):
    want_gx[r] = dy[r] @ w[g].T
    want_gw[g] += np.outer(x[r], dy[r])
  np.testing.assert_allclose(gx, want_gx * in_groups[:, None], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(gw, want_gw, atol=5e-5, rtol=1e-5)


# --- the MoE block against a per-token reference --------------------------------------------


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, T, D)).astype(np.float32)
  mask = rng.random((B, T)) > 0.2
  router = rng.normal(size=(D, X)).astype(np.float32)
  w = [(rng.normal(size=s) * 0.3).astype(np.float32) for s in ((X, D, F), (X, D, F), (X, F, D))]
  return x, mask, router, *w


def _per_token_reference(x, router, w_gate, w_up, w_down, norm, capacity=None):
  """Each token's chosen experts applied one by one (float64). With `capacity`, an expert keeps
  its first `capacity` assignments: every token's first choice before any second choice."""
  xs = x.reshape(-1, D).astype(np.float64)
  logits = xs @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
  weights = np.take_along_axis(probs, top, -1)
  if norm:
    weights /= weights.sum(-1, keepdims=True)
  taken, dropped = np.zeros(X, int), 0
  out = np.zeros_like(xs)
  for j in range(K):  # choice rank first, then token order
    for n, v in enumerate(xs):
      e = top[n, j]
      if capacity is not None:
        if taken[e] >= capacity:
          dropped += 1
          continue
        taken[e] += 1
      g, u = v @ w_gate[e], v @ w_up[e]
      out[n] += weights[n, j] * ((g / (1 + np.exp(-g)) * u) @ w_down[e])
  return out.reshape(x.shape), dropped


def _experts(w_gate, w_up, w_down):
  return {"gate": w_gate, "up": w_up, "down": w_down}


def _call(routing):
  """The jitted layer: (out, statistics), the chosen experts left out."""
  return jax.jit(lambda x, m, r, *w: moe_layer(x, m, {"weight": r}, _experts(*w), routing)[:2])


def _routing(norm=True, capacity_factor=0.0, impl="blocked"):
  return Routing(num_experts=X, top_k=K, norm_topk_prob=norm, capacity_factor=capacity_factor,
                 activation="silu", matmul_impl=impl, dtype="float32")


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("impl", ["blocked", "ragged"])
def test_dropless_block_equals_each_tokens_experts_applied_one_by_one(norm, impl):
  x, mask, router, wg, wu, wd = _inputs()
  out, stats, _ = jax.jit(lambda x, m, r, *w: moe_layer(x, m, {"weight": r}, _experts(*w),
                                                        _routing(norm, impl=impl)))(
      x, mask, router, wg, wu, wd)
  want, _ = _per_token_reference(x, router, wg, wu, wd, norm)
  # Padding (mask False) is not routed: its output is 0 (tests/test_moe_padding.py).
  np.testing.assert_allclose(out, want * mask[..., None], atol=1e-5, rtol=1e-5)
  assert float(stats["dropped"]) == 0 and float(stats["assignments"]) == mask.sum() * K


def _per_token_jax(x, router, w_gate, w_up, w_down, norm):
  """The reference in JAX, for gradients: each token's k experts gathered and applied to it
  alone (no sorting, no grouped matmul), summed with its routing weights."""
  x_ND = x.reshape(-1, D)
  probs_NX = jax.nn.softmax(x_ND @ router, axis=-1)
  weights_NK, top_NK = jax.lax.top_k(probs_NX, K)
  if norm:
    weights_NK = weights_NK / weights_NK.sum(-1, keepdims=True)

  def one_token(v_D, top_K, weights_K):
    def one_expert(e, w):
      h = jax.nn.silu(v_D @ w_gate[e]) * (v_D @ w_up[e])
      return w * (h @ w_down[e])
    return jax.vmap(one_expert)(top_K, weights_K).sum(0)
  return jax.vmap(one_token)(x_ND, top_NK, weights_NK).reshape(x.shape)


@pytest.mark.parametrize("norm", [True, False])
def test_dropless_block_gradients_equal_the_per_token_reference(norm):
  """d/d(input, router, every expert weight) of sum(out * dy): the block (sorted assignments,
  grouped matmuls, unsorting) against each token's experts applied one by one."""
  x, _, router, wg, wu, wd = _inputs(5)
  dy = np.random.default_rng(6).normal(size=x.shape).astype(np.float32)
  ones = np.ones(x.shape[:2], bool)

  def block(x, router, wg, wu, wd):
    return jnp.sum(moe_layer(x, ones, {"weight": router}, _experts(wg, wu, wd),
                             _routing(norm))[0] * dy)

  def reference(x, router, wg, wu, wd):
    return jnp.sum(_per_token_jax(x, router, wg, wu, wd, norm) * dy)

  args = (x, router, wg, wu, wd)
  got = jax.jit(jax.grad(block, argnums=(0, 1, 2, 3, 4)))(*args)
  want = jax.jit(jax.grad(reference, argnums=(0, 1, 2, 3, 4)))(*args)
  for name, a, b in zip(("x", "router", "w_gate", "w_up", "w_down"), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()),
                               err_msg=name)
    assert float(np.abs(b).max()) > 0, name


def test_capacity_mode_drops_past_capacity_in_choice_then_token_order():
  x, mask, router, wg, wu, wd = _inputs(1)
  routing = _routing(capacity_factor=1.0)
  cap = int(np.ceil(1.0 * B * T * K / X))
  out, stats = _call(routing)(x, np.ones_like(mask), router, wg, wu, wd)
  want, dropped = _per_token_reference(x, router, wg, wu, wd, True, capacity=cap)
  assert dropped > 0  # random routing overfills some expert at factor 1
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  assert float(stats["dropped"]) == dropped


def test_router_statistics_follow_their_formulas():
  x, mask, router, wg, wu, wd = _inputs(2)
  _, stats = _call(_routing())(x, mask, router, wg, wu, wd)
  xs, m = x.reshape(-1, D).astype(np.float64), mask.reshape(-1)
  logits = xs @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1)[:, :K]
  load = np.array([np.sum((top == e) * m[:, None]) for e in range(X)], np.float64)
  tokens = m.sum()
  aux = X * np.sum(load / (tokens * K) * (probs * m[:, None]).sum(0) / tokens)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(stats["expert_load"], load)
  np.testing.assert_allclose(stats["aux_loss"], aux, rtol=1e-5)
  np.testing.assert_allclose(stats["z_loss"], np.sum(lse ** 2 * m) / tokens, rtol=1e-5)
  np.testing.assert_allclose(stats["max_load"], load.max() / load.mean(), rtol=1e-6)
  # Balanced routing gives an aux loss of 1 (the form's floor): uniform router probabilities.
  _, even = _call(_routing())(x, mask, np.zeros_like(router), wg, wu, wd)
  assert float(even["aux_loss"]) == pytest.approx(X * K / X * 1 / X * X / K, rel=1e-6)


def _loss(x, mask, router, wg, wu, wd, routing):
  out, stats, _ = moe_layer(x, mask, {"weight": router}, _experts(wg, wu, wd), routing)
  return jnp.sum(out ** 2) + stats["aux_loss"] + stats["z_loss"]


@pytest.mark.parametrize("shape", [
    {"expert": 4, "fsdp": 2}, {"expert": 2, "data": 2, "tensor": 2}, {"fsdp": 4, "tensor": 2}])
def test_expert_parallel_block_equals_one_device_with_all_to_all(shape):
  """Forward and gradients (through the router, the aux and z losses, every weight) on 8
  devices equal one device's; with mesh.expert > 1 the compiled block exchanges tokens by
  all-to-all."""
  x, mask, router, wg, wu, wd = _inputs(3)
  grad = jax.jit(jax.value_and_grad(_loss, argnums=(0, 2, 3, 4, 5)), static_argnums=6)
  want = grad(x, mask, router, wg, wu, wd, _routing())
  mesh = mesh_of(shape)
  put = lambda a, names: jax.device_put(a, NamedSharding(mesh, logical_to_spec(names)))
  args = (put(x, ("act_batch", "act_length", None)), put(mask, ("act_batch", "act_length")),
          put(router, ("embed", None)), put(wg, ("experts", "expert_embed", "expert_mlp")),
          put(wu, ("experts", "expert_embed", "expert_mlp")),
          put(wd, ("experts", "expert_mlp", "expert_embed")))
  with jax.set_mesh(mesh):
    got = grad(*args, _routing())
    hlo = grad.lower(*args, _routing()).compile().as_text()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(np.abs(b).max()))
  assert ("all-to-all" in hlo) == (shape.get("expert", 1) > 1)


def test_capacity_mode_under_expert_parallelism_counts_each_devices_drops():
  x, mask, router, wg, wu, wd = _inputs(4)
  mesh = mesh_of({"expert": 4, "fsdp": 2})
  routing = _routing(capacity_factor=1.0)
  with jax.set_mesh(mesh):
    out, stats = _call(routing)(x, np.ones_like(mask), router, wg, wu, wd)
  # Capacity is per device: each of the 8 devices routes its own tokens (one row of 12).
  want = np.zeros_like(x)
  dropped = 0
  cap = int(np.ceil(1.0 * T * K / X))
  for b in range(B):
    row, n = _per_token_reference(x[b:b + 1], router, wg, wu, wd, True, capacity=cap)
    want[b], dropped = row[0], dropped + n
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  assert float(stats["dropped"]) == dropped


# --- configs and counts -----------------------------------------------------------------------


def _moe_config(**moe):
  c = small_config(family="mixtral")
  c.moe.num_experts, c.moe.experts_per_token, c.moe.expert_mlp_dim = 4, 2, 64
  for k, v in moe.items():
    setattr(c.moe, k, v)
  return c


@pytest.mark.parametrize("changes,devices,words", [
    ({"moe.experts_per_token": 5}, 1, ["moe.experts_per_token=5", "between 1 and",
                                       "moe.num_experts=4"]),
    ({"moe.num_experts": 6, "mesh.expert": 4, "mesh.fsdp": 1}, 4,
     ["mesh.expert=4", "does not divide", "moe.num_experts=6"]),
    ({"moe.num_experts": 0, "model.family": "llama", "mesh.expert": 2, "mesh.fsdp": 1}, 2,
     ["mesh.expert=2", "no MoE layers", "mesh.data or mesh.fsdp"]),
    ({"moe.capacity_factor": -1.0}, 1, ["moe.capacity_factor=-1.0", ">= 0"]),
    ({"moe.dense_layers": "1"}, 1, ["moe.dense_layers='1'", "must come first",
                                    "model.scan_layers=False"]),
    ({"moe.dense_layers": "0,1"}, 1, ["no MoE layer", "moe.num_experts=0"]),
    ({"moe.dense_layers": "7"}, 1, ["moe.dense_layers='7'", "0..1"]),
    ({"moe.grouped_matmul": "megablox"}, 1, ["moe.grouped_matmul='megablox'", "ragged"]),
    ({"mesh.stage": 2, "mesh.fsdp": 1}, 2, ["mesh.stage=2", "MoE layers", "not supported"]),
    ({"model.family": "llama"}, 1, ["model.family='llama'", "mixtral, qwen3_moe"]),
    ({"model.family": "qwen3_moe", "moe.num_experts": 0}, 1,
     ["model.family='qwen3_moe'", "moe.num_experts > 0"]),
])
def test_bad_moe_settings_are_one_line_errors(changes, devices, words):
  assert_one_line_config_error(with_changes(_moe_config(), changes), devices, words)


@pytest.mark.parametrize("name,total,active", [
    # Published sizes: Mixtral 8x7B 46.7B total / 12.9B active; Qwen3-30B-A3B 30.5B / 3.3B;
    # Qwen3-235B-A22B 235B / 22B.
    ("mixtral_8x7b", 46.70e9, 12.88e9),
    ("qwen3_30b_a3b", 30.53e9, 3.34e9),
    ("qwen3_235b_a22b", 235.1e9, 22.2e9),
    # DeepSeek-V3 671B / 37B plus its multi-token-prediction module (11.6B, 0.66B active; the
    # hub's 685B also counts that module's own copies of the embedding and head); Kimi K2
    # "1T" / 32B.
    ("deepseek_v3_671b", 682.6e9, 38.2e9),
    ("kimi_k2_1t", 1.026e12, 32.9e9),
])
def test_total_and_active_parameters_of_the_moe_configs(name, total, active):
  from jaxtrain.config import load_config_file  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.config import architecture_of  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  arch = architecture_of(load_config_file(os.path.join("configs", f"{name}.py")))
  assert cost.param_count(arch) == pytest.approx(total, rel=0.005)
  assert cost.param_count(arch, active=True) == pytest.approx(active, rel=0.01)


def test_flops_count_the_router_and_the_active_experts_only():
  dense = Architecture(vocab_size=100, num_layers=2, d_model=16, num_heads=2, num_kv_heads=2,
                       head_dim=8, mlp_dim=32)
  moe = Architecture(**{**dense.__dict__, "num_experts": 8, "experts_per_token": 2,
                        "expert_mlp_dim": 16, "family": "mixtral"})
  # Two experts of 16 are one MLP of 32, plus the router's D*X per layer.
  assert cost.matmul_params(moe) == cost.matmul_params(dense) + 2 * 16 * 8
  assert cost.param_count(moe) == cost.param_count(dense) + 2 * (16 * 8 + 6 * 3 * 16 * 16)
  assert cost.param_count(moe, active=True) == cost.param_count(dense) + 2 * 16 * 8
