"""Tests for jaxtrain.model: shapes, causality, packing, scan/remat equivalence, sharding, RoPE."""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import config as config_lib
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model, create_model, init_params_fn
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel.mesh import LOGICAL_RULES
from jaxtrain.train import metrics

B, T = 2, 16
CFG = ModelConfig.of(vocab_size=128, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                  head_dim=16, mlp_dim=128)


# --------------------------------------------------------------------------------------------
# Helpers: jitted pure functions of (graphdef, params) so compiled code is shared across tests.
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens, positions=None, segment_ids=None):
  return nnx.merge(graphdef, params)(tokens, positions, segment_ids)


@functools.partial(jax.jit, static_argnums=0)
def _hidden(graphdef, params, tokens):
  return nnx.merge(graphdef, params).hidden_states(tokens)


@functools.partial(jax.jit, static_argnums=0)
def _logits_and_grads(graphdef, params, tokens, weights):
  """(logits, d loss / d params) for the scalar loss sum(logits * weights)."""
  def loss(params):
    logits = nnx.merge(graphdef, params)(tokens)
    return jnp.sum(logits * weights), logits
  (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return logits, grads


def _with_values(cfg, mesh, pure):
  """(graphdef, params) for `cfg` holding the given pure-dict values; no init is compiled.

  `create_model` compiles the random init (seconds on CPU), so variants that must share the
  base model's values take its layout from `abstract_model` and fill in the arrays.
  """
  graphdef, params, _ = abstract_model(cfg, mesh)
  nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, pure))
  return graphdef, params


def _pure(state):
  """Plain nested dict of numpy arrays."""
  return jax.tree.map(np.asarray, nnx.to_pure_dict(state))


def _stacked_to_list(pure, num_layers):
  """Scanned layout (`layers` leaves stacked [L, ...]) -> unrolled (`layers` -> {i: ...})."""
  out = dict(pure)
  out["layers"] = {i: jax.tree.map(lambda x, i=i: x[i], pure["layers"]) for i in range(num_layers)}
  return out


def _assert_trees_close(got, want, atol, rtol=0.0):
  got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
  want_flat = jax.tree_util.tree_flatten_with_path(want)[0]
  assert [p for p, _ in got_flat] == [p for p, _ in want_flat]
  for (path, g), (_, w) in zip(got_flat, want_flat):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=rtol,
                               err_msg=jax.tree_util.keystr(path))


def _tokens(seed=0, b=B, t=T, vocab=CFG.arch.vocab_size):
  return np.random.default_rng(seed).integers(0, vocab, (b, t), dtype=np.int32)


@pytest.fixture(scope="module")
def mesh1():
  return mesh_lib.make_mesh(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def base(mesh1):
  """(graphdef, params) of the base scanned model, seed 0."""
  return nnx.split(create_model(CFG, mesh1, seed=0))


@pytest.fixture(scope="module")
def grad_weights():
  return jax.random.normal(jax.random.key(42), (B, T, CFG.arch.vocab_size), jnp.float32)


@pytest.fixture(scope="module")
def base_logits_and_grads(mesh1, base, grad_weights):
  graphdef, params = base
  with jax.set_mesh(mesh1):
    logits, grads = _logits_and_grads(graphdef, params, _tokens(), grad_weights)
  return np.asarray(logits), _pure(grads)


# --------------------------------------------------------------------------------------------
# Shapes, causality, packing.
# --------------------------------------------------------------------------------------------


def test_output_shapes(mesh1, base):
  graphdef, params = base
  tokens = _tokens()
  with jax.set_mesh(mesh1):
    logits = _logits(graphdef, params, tokens)
    hidden = _hidden(graphdef, params, tokens)
  assert logits.shape == (B, T, CFG.arch.vocab_size) and logits.dtype == jnp.float32
  assert hidden.shape == (B, T, CFG.arch.d_model) and hidden.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(logits)))
  # Logits are the head applied to the final hidden states.
  model = nnx.merge(graphdef, params)
  np.testing.assert_allclose(logits, np.asarray(hidden) @ np.asarray(model.head_weights()),
                             atol=1e-5, rtol=1e-5)


def test_default_positions_and_segments(mesh1, base):
  """No positions means 0..T-1; no segment ids means one document per row."""
  graphdef, params = base
  tokens = _tokens()
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  with jax.set_mesh(mesh1):
    default = _logits(graphdef, params, tokens)
    explicit = _logits(graphdef, params, tokens, positions, np.ones((B, T), np.int32))
  np.testing.assert_allclose(default, explicit, atol=1e-6, rtol=0)


@pytest.mark.parametrize("t", [0, 5, T - 1])
def test_causality(mesh1, base, t):
  graphdef, params = base
  tokens = _tokens()
  changed = tokens.copy()
  changed[:, t] = (changed[:, t] + 1 + np.arange(B)) % CFG.arch.vocab_size
  with jax.set_mesh(mesh1):
    before = np.asarray(_logits(graphdef, params, tokens))
    after = np.asarray(_logits(graphdef, params, changed))
  np.testing.assert_allclose(after[:, :t], before[:, :t], atol=1e-6, rtol=0)
  assert np.all(np.abs(after[:, t] - before[:, t]).max(axis=-1) > 1e-4)
  if t + 1 < T:  # and the change propagates forward
    assert np.all(np.abs(after[:, t + 1:] - before[:, t + 1:]).max(axis=-1) > 1e-6)


def test_packed_segments_do_not_interact(mesh1, base):
  """Packing A then B in one row gives each document the logits it has alone."""
  graphdef, params = base
  la, lb = 6, 10
  rng = np.random.default_rng(3)
  doc_a = rng.integers(0, CFG.arch.vocab_size, la, dtype=np.int32)
  doc_b = rng.integers(0, CFG.arch.vocab_size, lb, dtype=np.int32)
  pad_a = rng.integers(0, CFG.arch.vocab_size, T - la, dtype=np.int32)  # filler, segment 0
  pad_b = rng.integers(0, CFG.arch.vocab_size, T - lb, dtype=np.int32)
  tokens = np.stack([
      np.concatenate([doc_a, doc_b]),  # packed: A | B
      np.concatenate([doc_b, pad_b]),  # B alone, then padding
      np.concatenate([doc_a, pad_a]),  # A alone, then padding
      np.concatenate([doc_b, doc_a]),  # packed the other way: B | A (other segment ids)
  ])
  segment_ids = np.array([
      [1] * la + [2] * lb,
      [1] * lb + [0] * (T - lb),
      [1] * la + [0] * (T - la),
      [7] * lb + [3] * la,
  ], dtype=np.int32)
  positions = np.array([
      list(range(la)) + list(range(lb)),
      list(range(lb)) + list(range(T - lb)),
      list(range(la)) + list(range(T - la)),
      list(range(lb)) + list(range(la)),
  ], dtype=np.int32)
  with jax.set_mesh(mesh1):
    logits = np.asarray(_logits(graphdef, params, tokens, positions, segment_ids))
  assert np.all(np.isfinite(logits))
  b_alone, a_alone = logits[1, :lb], logits[2, :la]
  np.testing.assert_allclose(logits[0, la:], b_alone, atol=1e-5, rtol=0)
  np.testing.assert_allclose(logits[0, :la], a_alone, atol=1e-5, rtol=0)
  np.testing.assert_allclose(logits[3, :lb], b_alone, atol=1e-5, rtol=0)
  np.testing.assert_allclose(logits[3, lb:], a_alone, atol=1e-5, rtol=0)
  # Sanity: without segment ids B's logits do depend on the A before it.
  with jax.set_mesh(mesh1):
    unpacked = np.asarray(_logits(graphdef, params, tokens, positions,
                                  np.ones_like(segment_ids)))
  assert np.abs(unpacked[0, la:] - b_alone).max() > 1e-4


# --------------------------------------------------------------------------------------------
# Equivalent model variants: scan vs unrolled, remat policies.
# --------------------------------------------------------------------------------------------


def test_scan_matches_unrolled(mesh1, base, base_logits_and_grads, grad_weights):
  _, scanned_params = base
  scanned_logits, scanned_grads = base_logits_and_grads
  cfg = CFG.replace(scan_layers=False)
  graphdef, params, _ = abstract_model(cfg, mesh1)
  assert isinstance(nnx.merge(graphdef, params).layers, nnx.List)
  unrolled_layout = _stacked_to_list(_pure(scanned_params), CFG.arch.num_layers)
  want_shapes = jax.tree.map(lambda x: x.shape, unrolled_layout)
  assert jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(params)) == want_shapes
  nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, unrolled_layout))
  _assert_trees_close(_pure(params), unrolled_layout, atol=0)
  with jax.set_mesh(mesh1):
    logits, grads = _logits_and_grads(graphdef, params, _tokens(), grad_weights)
  np.testing.assert_allclose(logits, scanned_logits, atol=1e-5, rtol=0)
  _assert_trees_close(_pure(grads), _stacked_to_list(scanned_grads, CFG.arch.num_layers),
                      atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["none", "full", "save_dots", "save_qkv_proj"])
def test_remat_policies_match(mesh1, base, base_logits_and_grads, grad_weights, policy):
  """Every remat policy gives the same params, logits and grads as the base (`minimal`)."""
  assert CFG.runtime.remat_policy == "minimal"
  _, base_params = base
  want_logits, want_grads = base_logits_and_grads
  cfg = CFG.replace(remat_policy=policy)
  # Same params for the same seed: the init program is identical (remat changes only the
  # forward pass), so its values are too; and the layout (shapes, shardings) is the same.
  key = jax.random.key(0)
  with jax.set_mesh(mesh1):
    assert (str(jax.make_jaxpr(init_params_fn(cfg))(key))
            == str(jax.make_jaxpr(init_params_fn(CFG))(key)))
  graphdef, params = _with_values(cfg, mesh1, _pure(base_params))
  assert jax.tree.structure(params) == jax.tree.structure(base_params)
  with jax.set_mesh(mesh1):
    logits, grads = _logits_and_grads(graphdef, params, _tokens(), grad_weights)
  np.testing.assert_allclose(logits, want_logits, atol=1e-6, rtol=0)
  _assert_trees_close(_pure(grads), want_grads, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("policy", ["minimal", "none"])
def test_explicit_transpose_for_dw_matches(mesh1, base, base_logits_and_grads, grad_weights,
                                           policy):
  """The CPU weight-gradient form (x^T copied out, then a plain GEMM) gives the base's logits
  and grads, and the remat policy sees through its custom_vjp: `minimal` saves the same
  residuals as without it."""
  _, base_params = base
  want_logits, want_grads = base_logits_and_grads
  cfg = CFG.replace(remat_policy=policy, explicit_transpose_for_dw=True)
  graphdef, params = _with_values(cfg, mesh1, _pure(base_params))
  tokens = _tokens()
  with jax.set_mesh(mesh1):
    logits, grads = _logits_and_grads(graphdef, params, tokens, grad_weights)
    # The plain form's backward is XLA's transpose of x @ w: its dW contracts x untransposed.
    jaxpr = str(jax.make_jaxpr(jax.grad(
        lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens) * grad_weights)))(params))
  assert "optimization_barrier" in jaxpr
  np.testing.assert_allclose(logits, want_logits, atol=1e-6, rtol=0)
  _assert_trees_close(_pure(grads), want_grads, atol=1e-6, rtol=1e-6)

  def residual_shapes(c):
    g, p = _with_values(c, mesh1, _pure(base_params))
    loss = lambda p: jnp.sum(nnx.merge(g, p)(tokens) * grad_weights)
    out = io.StringIO()
    with jax.set_mesh(mesh1), contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(loss, p)
    return sorted(line.split()[0] for line in out.getvalue().splitlines() if line.strip())
  assert residual_shapes(cfg) == residual_shapes(cfg.replace(
                                                                     explicit_transpose_for_dw=False))


def test_from_config_sets_explicit_transpose_for_cpu_only():
  config = config_lib.default_config()
  assert ModelConfig.from_config(config, platform="cpu").runtime.explicit_transpose_for_dw
  for platform in ("gpu", "tpu"):
    assert not ModelConfig.from_config(config, platform=platform).runtime.explicit_transpose_for_dw


# --------------------------------------------------------------------------------------------
# Embeddings and parameter count.
# --------------------------------------------------------------------------------------------


def test_tied_embeddings(mesh1, base):
  cfg = CFG.replace(tie_embeddings=True)
  # The tied layout is the untied one without the head; reuse the base values (see _with_values).
  _, abstract, _ = abstract_model(cfg, mesh1)
  assert "head_DV" not in nnx.to_pure_dict(abstract)
  pure = _pure(base[1])
  del pure["head_DV"]
  graphdef, params = _with_values(cfg, mesh1, pure)
  model = nnx.merge(graphdef, params)
  assert not hasattr(model, "head_DV")
  assert sum(x.size for x in jax.tree.leaves(params)) == metrics.count_params(cfg.arch)
  assert metrics.count_params(cfg.arch) == metrics.count_params(CFG.arch) - CFG.arch.d_model * CFG.arch.vocab_size
  np.testing.assert_array_equal(np.asarray(model.head_weights()), pure["embed_VD"].T)
  with jax.set_mesh(mesh1):
    logits = _logits(graphdef, params, _tokens())
    hidden = _hidden(graphdef, params, _tokens())
  np.testing.assert_allclose(logits, np.asarray(hidden) @ pure["embed_VD"].T, atol=1e-5, rtol=1e-5)


def test_untied_param_count(base):
  _, params = base
  pure = _pure(params)
  assert pure["head_DV"].shape == (CFG.arch.d_model, CFG.arch.vocab_size)
  assert sum(x.size for x in jax.tree.leaves(pure)) == metrics.count_params(CFG.arch)
  assert pure["layers"]["attn"]["wq_DHE"].shape == (CFG.arch.num_layers, CFG.arch.d_model, CFG.arch.num_heads,
                                                    CFG.arch.head_dim)


# --------------------------------------------------------------------------------------------
# Sharding on a (data=1, fsdp=2, tensor=4) mesh.
# --------------------------------------------------------------------------------------------


MESH_CFG = ModelConfig.of(vocab_size=128, num_layers=2, d_model=64, num_heads=8, num_kv_heads=4,
                       head_dim=16, mlp_dim=128)
# Weights named `embed` shard over fsdp, context and expert, stacked layers over stage
# (mesh.LOGICAL_RULES).
EMBED = ("fsdp", "context", "expert")
EXPECTED_SPECS = {
    ("embed_VD",): P("tensor", EMBED),
    ("head_DV",): P(EMBED, "tensor"),
    ("final_norm", "scale"): P(None),
    ("layers", "attn", "wq_DHE"): P("stage", EMBED, "tensor", None),
    ("layers", "attn", "wk_DKE"): P("stage", EMBED, "tensor", None),
    ("layers", "attn", "wv_DKE"): P("stage", EMBED, "tensor", None),
    ("layers", "attn", "wo_HED"): P("stage", "tensor", None, EMBED),
    ("layers", "attn_norm", "scale"): P("stage", None),
    ("layers", "mlp", "w_gate_DF"): P("stage", EMBED, "tensor"),
    ("layers", "mlp", "w_up_DF"): P("stage", EMBED, "tensor"),
    ("layers", "mlp", "w_down_FD"): P("stage", "tensor", EMBED),
    ("layers", "mlp_norm", "scale"): P("stage", None),
}


def _path_names(path):
  return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def test_params_sharded_by_logical_axes(mesh1):
  assert len(jax.devices()) == 8
  mesh = mesh_lib.make_mesh({"fsdp": 2, "tensor": 4})
  model = create_model(MESH_CFG, mesh, seed=0)
  state = nnx.state(model)
  rules = dict(LOGICAL_RULES)

  # Every Param names each of its dims with a logical axis from LOGICAL_RULES.
  variables = jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  seen = set()
  for path, var in variables:
    assert isinstance(var, nnx.Param), path
    names = var.get_metadata().get("out_sharding")
    value = var[...]
    assert names is not None and len(names) == value.ndim, (path, names)
    assert all(n in rules for n in names), (path, names)
    seen.add(_path_names(path))
  assert seen == set(EXPECTED_SPECS)

  # The arrays are actually laid out by those rules.
  arrays = jax.tree_util.tree_leaves_with_path(state)
  assert len(arrays) == len(EXPECTED_SPECS)
  for path, arr in arrays:
    names = _path_names(path)
    names = names[:-1] if names[-1] == "value" else names
    want = NamedSharding(mesh, EXPECTED_SPECS[names])
    assert arr.sharding.is_equivalent_to(want, arr.ndim), (names, arr.sharding.spec)
  wq = state["layers"]["attn"]["wq_DHE"][...]
  assert wq.sharding.spec == P("stage", EMBED, "tensor", None)
  assert wq.sharding.shard_shape(wq.shape) == (2, 32, 2, 16)
  assert state["embed_VD"][...].sharding.spec == P("tensor", EMBED)

  # The sharded model computes what the same params compute on one device.
  tokens = _tokens(seed=5)
  with jax.set_mesh(mesh):
    logits = _logits(*nnx.split(model), tokens)
  assert logits.sharding.mesh.shape == mesh.shape
  with jax.set_mesh(mesh1):
    want = _logits(*_with_values(MESH_CFG, mesh1, _pure(state)), tokens)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5, rtol=0)
