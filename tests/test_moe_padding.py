"""Padding in the MoE block (models/moe.py): masked positions are never routed, on every route,
so the real tokens' outputs, drops, group sizes and router statistics are the same whatever
padding a batch holds and wherever it sits (issue 54)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxtrain.models.moe import Routing, local_experts, moe_ffn, moe_layer
from jaxtrain.parallel.expert_parallel import Sequences
from jaxtrain.parallel.mesh import logical_to_spec
from tests.helpers import mesh_of

X, D, F, K = 4, 8, 16, 2
REAL, PAD = 8, 4  # real tokens per row, padding positions per padded row


def _weights(seed=0):
  rng = np.random.default_rng(seed)
  router = rng.normal(size=(D, X)).astype(np.float32)
  w = [(rng.normal(size=s) * 0.3).astype(np.float32) for s in ((X, D, F), (X, D, F), (X, F, D))]
  return {"weight": router, "bias": rng.normal(size=(X,)).astype(np.float32) * 0.1}, \
      dict(zip(("gate", "up", "down"), w))


def _layouts(rows, pad_at, seed=1):
  """{where: (x_BTD, mask_BT)}: the same `rows` x REAL real tokens without padding and with
  PAD positions of one padding vector (it shares one embedding, so at the first MoE layer it
  all picks the same experts) at each place of `pad_at` ("end", "start", "both")."""
  rng = np.random.default_rng(seed)
  real = rng.normal(size=(rows, REAL, D)).astype(np.float32)
  pad = np.broadcast_to(rng.normal(size=(D,)).astype(np.float32) * 3, (rows, PAD, D))
  parts = {"end": (real, pad), "start": (pad, real),
           "both": (pad[:, :PAD // 2], real, pad[:, PAD // 2:])}
  out = {"none": (real, np.ones((rows, REAL), bool))}
  for where in pad_at:
    out[where] = (np.concatenate(parts[where], axis=1),
                  np.concatenate([np.full(p.shape[:2], p is real) for p in parts[where]], axis=1))
  return out


def _routing(capacity_factor=0.0, impl="blocked", deepseek=False):
  extra = dict(score="sigmoid", n_group=2, topk_group=1, sequence_balance=True) if deepseek else {}
  return Routing(num_experts=X, top_k=K, norm_topk_prob=True, capacity_factor=capacity_factor,
                 activation="silu", matmul_impl=impl, dtype="float32", **extra)


def _block(routing, router, experts):
  """The jitted one-device block on [B, T, D]: (out_BTD, statistics, the group sizes the
  dispatch was handed)."""
  if routing.score == "softmax":
    router = {"weight": router["weight"]}

  @jax.jit
  def run_block(x_BTD, mask_BT):
    b, t, d = x_BTD.shape
    handed = {}

    def run(x_AD, expert_A, group_sizes_X):
      handed["group_sizes"] = group_sizes_X
      return local_experts(experts, routing, b * t)(x_AD, expert_A, group_sizes_X)

    out_ND, stats, _ = moe_ffn(x_BTD.reshape(b * t, d), mask_BT.reshape(b * t), router, run,
                               routing, sequences=Sequences(rows=b))
    return out_ND.reshape(b, t, d), stats, handed["group_sizes"]
  return run_block


@pytest.mark.parametrize("routing", [
    _routing(), _routing(impl="ragged", deepseek=True), _routing(capacity_factor=1.0)],
    ids=["dropless", "dropless-deepseek-ragged", "capacity"])
def test_padding_is_never_routed_wherever_it_sits(routing):
  """[real], [real, pad], [pad, real] of the same tokens: the same outputs on the real
  positions, 0 on the padding; the same group sizes (real assignments only), drops, loads and
  balance losses."""
  router, experts = _weights()
  block = _block(routing, router, experts)
  got = {where: block(x, mask) + (mask,)
         for where, (x, mask) in _layouts(2, ("end", "start")).items()}
  want_out, want_stats, want_sizes, _ = got["none"]
  assert int(want_sizes.sum()) == 2 * REAL * K
  if routing.capacity_factor > 0:
    assert float(want_stats["dropped"]) > 0  # the real tokens overfill some expert
  for where, (out, stats, sizes, mask) in got.items():
    np.testing.assert_allclose(out[mask].reshape(want_out.shape), want_out, atol=1e-6,
                               err_msg=f"real outputs, padding at {where}")
    for name in ("dropped", *sorted(set(want_stats) - {"dropped"})):
      np.testing.assert_allclose(stats[name], want_stats[name], rtol=1e-6,
                                 err_msg=f"{name}, padding at {where}")
    np.testing.assert_array_equal(sizes, want_sizes, err_msg=f"group sizes, padding at {where}")
    np.testing.assert_array_equal(out[~mask], 0, err_msg=f"padding's outputs at {where}")


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_padding_is_never_routed_under_expert_parallelism(capacity_factor):
  """The all-to-all routes (mesh.expert = 4, one row per device): padding at both ends of every
  row changes neither the real tokens' outputs nor the statistics."""
  router, experts = _weights(2)
  routing = _routing(capacity_factor)
  mesh = mesh_of({"expert": 4, "fsdp": 2})
  put = lambda a, names: jax.device_put(a, NamedSharding(mesh, logical_to_spec(names)))
  names = {"gate": ("experts", "expert_embed", "expert_mlp"),
           "up": ("experts", "expert_embed", "expert_mlp"),
           "down": ("experts", "expert_mlp", "expert_embed")}
  block = jax.jit(lambda x, m, r, w: moe_layer(x, m, r, w, routing)[:2])
  got = {}
  with jax.set_mesh(mesh):
    w = {k: put(v, names[k]) for k, v in experts.items()}
    r = {"weight": put(router["weight"], ("embed", None))}
    for where, (x, mask) in _layouts(8, ("both",), seed=3).items():
      out, stats = block(put(x, ("act_batch", "act_length", None)),
                         put(mask, ("act_batch", "act_length")), r, w)
      got[where] = (np.asarray(out), stats, mask)
  want_out, want_stats, _ = got["none"]
  if capacity_factor > 0:
    assert float(want_stats["dropped"]) > 0
  out, stats, mask = got["both"]
  np.testing.assert_allclose(out[mask].reshape(want_out.shape), want_out, atol=1e-6,
                             err_msg="real outputs")
  for name in ("dropped", *sorted(set(want_stats) - {"dropped"})):
    np.testing.assert_allclose(stats[name], want_stats[name], rtol=1e-6, err_msg=name)
  np.testing.assert_array_equal(out[~mask], 0, err_msg="padding's outputs")
