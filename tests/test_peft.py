"""LoRA / QLoRA at the model level: adapters, quantized base, dropout, state split, sharding."""

import contextlib
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtrain.config import LORA_TARGETS, load_config_file
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.decoder import Decoder
from jaxtrain.models.sharding import abstract_model
from jaxtrain.ops import quantize
from jaxtrain.parallel.mesh import LOGICAL_RULES
from jaxtrain.peft import lora as lora_lib
from jaxtrain.peft import state as peft_state
from tests.helpers import mesh_of, small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T = 2, 16
# D=64, H*E=64, F=128: group 16 splits every input dim into groups that shard on (2,2,2).
BASE = ModelConfig.of(vocab_size=128, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                   head_dim=16, mlp_dim=128)


def _lora(base=BASE, rank=4, targets=LORA_TARGETS, quant="none", group=16, dropout=0.0,
          alpha=8.0):
  return base.replace(lora_rank=rank, lora_alpha=alpha, lora_dropout=dropout,
                             lora_targets=tuple(targets), base_quant=quant,
                             quant_group_size=group)


@contextlib.contextmanager
def _one_device():
  """Model construction applies logical shardings: it needs the rules and a mesh."""
  with jax.set_mesh(mesh_of((1, 1, 1))), nnx.logical_axis_rules(LOGICAL_RULES):
    yield


@functools.lru_cache(maxsize=None)
def _split(cfg):
  """(graphdef, abstract adapters, abstract rest) of model `cfg`: shapes only, no compile."""
  with _one_device():
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), lora_lib.Adapter, ...)


def _graphdef(cfg):
  return _split(cfg)[0]


def _filled(abstract, seed, random_b=False):
  """`abstract` state with numpy values (a compiled random init costs seconds per config):
  weights ~ N(0, 0.02^2) (the model's init_std), A ~ N(0, 0.05^2), norm scales 1, B zero unless
  `random_b` (then N(0, 0.1^2))."""
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = path[-2].key if isinstance(path[-2], jax.tree_util.DictKey) else str(path[-2])
    if name == "scale":
      return np.ones(leaf.shape, leaf.dtype)
    if name == "b_RO" and not random_b:
      return np.zeros(leaf.shape, leaf.dtype)
    std = {"b_RO": 0.1, "a_IR": 0.05}.get(name, 0.02)
    return (std * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
  return jax.tree_util.tree_map_with_path(fill, abstract)


def _tokens(seed=0):
  return np.random.default_rng(seed).integers(0, BASE.arch.vocab_size, (B, T), dtype=np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, states, tokens, key=None):
  return nnx.merge(graphdef, *states)(tokens, dropout_key=key)


def _init_plain(cfg):
  graphdef, _, params = _split(cfg)
  return graphdef, _filled(params, seed=0)


@functools.lru_cache(maxsize=None)
def _base(scan_layers=True):
  """(graphdef, params) of a plain model."""
  return _init_plain(BASE.replace(scan_layers=scan_layers))


_frozen = jax.jit(peft_state.frozen_from_base, static_argnums=1)


def _lora_model(cfg, base_params, seed=1, random_b=False):
  """(graphdef, adapters, frozen) of a LoRA model on `base_params`; B random if asked."""
  graphdef, adapters, _ = _split(cfg)
  adapters = _filled(adapters, seed, random_b)
  return graphdef, adapters, _frozen(base_params, cfg)


def _flat(state):
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in
          jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))}


# --------------------------------------------------------------------------------------------
# Config and variable types.
# --------------------------------------------------------------------------------------------


def test_from_config_maps_lora_group():
  config = small_config()
  assert ModelConfig.from_config(config) == peft_state.plain_config(ModelConfig.from_config(config))
  config.lora.rank, config.lora.alpha, config.lora.dropout = 8, 32.0, 0.1
  config.lora.targets, config.lora.quantize_base, config.lora.quant_group_size = \
      "v,q,down", "nf4", 32
  cfg = ModelConfig.from_config(config)
  assert (cfg.peft.lora_rank, cfg.peft.lora_alpha, cfg.peft.lora_dropout) == (8, 32.0, 0.1)
  assert cfg.peft.lora_targets == ("q", "v", "down")  # canonical order
  assert (cfg.peft.base_quant, cfg.peft.quant_group_size) == ("nf4", 32)
  config.lora.rank = 0
  config.lora.quantize_base = "none"
  assert ModelConfig.from_config(config) == peft_state.plain_config(cfg)


def test_adapter_is_not_a_param():
  # nnx.LoRAParam subclasses Param, which is why adapters have a type of their own.
  assert issubclass(nnx.LoRAParam, nnx.Param)
  assert not issubclass(lora_lib.Adapter, nnx.Param)
  assert not issubclass(quantize.Quantized, (nnx.Param, lora_lib.Adapter))
  with _one_device():
    model = nnx.eval_shape(lambda: Decoder(_lora(quant="nf4"), rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  adapters = nnx.state(model, peft_state.trainable_filter(model.cfg))
  quantized = nnx.state(model, quantize.Quantized)
  leaves = lambda s: jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, nnx.Variable))  # noqa
  assert all(type(v) is nnx.Param for v in leaves(params))
  assert all(type(v) is lora_lib.Adapter for v in leaves(adapters))
  assert all(type(v) is quantize.Quantized for v in leaves(quantized))
  assert len(leaves(params)) == 5  # embedding, head, final norm, the two (stacked) block norms
  assert len(leaves(adapters)) == 2 * 7 and len(leaves(quantized)) == 2 * 7
  assert peft_state.trainable_filter(BASE) is nnx.Param


def test_adapters_float32_over_a_bfloat16_base():
  cfg = _lora(quant="none").replace(param_dtype="bfloat16", dtype="bfloat16")
  _, adapters, frozen = _split(cfg)
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
  counts = peft_state.parameter_counts(cfg)
  assert counts.trainable_bytes == 4 * counts.trainable
  assert counts.frozen_bytes == 2 * (counts.total - counts.trainable)


@pytest.mark.parametrize("change, match", [
    (dict(base_quant="nf4", lora_rank=0), "needs lora.rank > 0"),
    (dict(lora_rank=4, lora_targets=("q", "qq")), "unknown qq"),
    (dict(lora_rank=4, lora_targets=()), "empty"),
    (dict(lora_rank=4, lora_targets=("q",), base_quant="nf8"), "choose one of"),
    (dict(lora_rank=4, lora_targets=("q",), base_quant="nf4", quant_group_size=48),
     r"model.d_model=64.*e.g. 64"),
    (dict(lora_rank=4, lora_targets=("q",), base_quant="int4", quant_group_size=7),
     "positive even"),
])
def test_bad_model_configs_are_named(change, match):
  with pytest.raises(ValueError, match=match):
    Decoder(BASE.replace(**change), rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------------------------
# LoRA numerics.
# --------------------------------------------------------------------------------------------


def test_adapter_init_and_axes():
  with _one_device():
    lora = lora_lib.LoRA("o", "wo_HED", (4, 16, 64), ("heads", "head_dim", "embed"), 2, 8, 16.0,
                     0.0, jnp.float32, nnx.Rngs(0))
    assert lora_lib.adapter(_lora(targets=("q",)).peft, nnx.Rngs(0), "o", "wo_HED", (4, 16, 64),
                        ("heads", "head_dim", "embed"), 2) is None
  a, b = np.asarray(lora.a_IR[...]), np.asarray(lora.b_RO[...])
  assert a.shape == (4, 16, 8) and b.shape == (8, 64)
  assert np.all(b == 0)  # so the model starts as its base
  assert 0.1 < np.abs(a).max() <= 1 / 8  # Kaiming-uniform: +-1/sqrt(fan_in = H*E = 64)
  assert lora.a_IR.out_sharding == ("heads", "head_dim", "lora_rank")
  assert lora.b_RO.out_sharding == ("lora_rank", "embed")
  assert lora.scale == 2.0


@pytest.mark.parametrize("scan_layers", [True, False])
def test_lora_at_init_equals_base_exactly(scan_layers):
  graphdef, params = _base(scan_layers)
  cfg = _lora(BASE.replace(scan_layers=scan_layers))
  want = _logits(graphdef, (params,), _tokens())
  graphdef, adapters, frozen = _lora_model(cfg, params)
  got = _logits(graphdef, (adapters, frozen), _tokens())
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_lora_equals_merged_plain_model(scan_layers):
  base_graphdef, params = _base(scan_layers)
  cfg = _lora(BASE.replace(scan_layers=scan_layers))
  graphdef, adapters, frozen = _lora_model(cfg, params, random_b=True)
  got = _logits(graphdef, (adapters, frozen), _tokens())
  merge = lambda a, f: peft_state.merged_params(nnx.merge(graphdef, a, f))
  merged = jax.jit(merge)(adapters, frozen)
  # The merged tree is the plain model's: same paths, shapes, dtypes, logical axes.
  with _one_device():
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(peft_state.plain_config(cfg),
                                                      rngs=nnx.Rngs(0))))
  assert jax.tree.structure(merged) == jax.tree.structure(abstract)
  for m, a in zip(jax.tree.leaves(merged, is_leaf=lambda x: isinstance(x, nnx.Variable)),
                  jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))):
    assert (m.shape, m.dtype, m.out_sharding) == (a.shape, a.dtype, a.out_sharding)
  want = _logits(base_graphdef, (merged,), _tokens())
  base = _logits(base_graphdef, (params,), _tokens())
  err = float(jnp.max(jnp.abs(got - want)))
  print(f"\nLoRA vs merged (scan={scan_layers}): max abs {err:.2e}; "
        f"adapter moved logits by {float(jnp.max(jnp.abs(got - base))):.2e}")
  assert err < 1e-5
  assert float(jnp.max(jnp.abs(got - base))) > 1e-2  # the adapters did something


def test_grads_only_on_adapters_of_the_targets():
  targets = ("q", "o", "down")
  cfg = _lora(targets=targets, rank=4)
  graphdef, adapters, frozen = _lora_model(cfg, _base()[1], random_b=True)

  @jax.jit
  def grads(adapters, frozen):
    def loss(adapters, frozen):
      # copy=True: new Variables at this trace level for the outer trace's frozen state, which
      # nnx.scan could not otherwise extract ("different trace level").
      return jnp.mean(nnx.merge(graphdef, adapters, frozen, copy=True)(_tokens()) ** 2)
    return jax.grad(loss)(adapters, frozen)  # w.r.t. the trainable part only

  g = _flat(grads(adapters, frozen))
  assert sorted(g) == sorted(f"['layers']['attn']['lora_{t}']['{n}']" for t in ("q", "o")
                             for n in ("a_IR", "b_RO")) + sorted(
      f"['layers']['mlp']['lora_down']['{n}']" for n in ("a_IR", "b_RO"))
  assert all(np.abs(v).max() > 0 for v in g.values())
  L, D, H, E, F, r = BASE.arch.num_layers, BASE.arch.d_model, BASE.arch.num_heads, BASE.arch.head_dim, \
      BASE.arch.mlp_dim, 4
  formula = L * r * ((D + H * E) + (H * E + D) + (F + D))
  assert sum(v.size for v in g.values()) == formula
  counts = peft_state.parameter_counts(cfg)
  plain = peft_state.parameter_counts(BASE)
  assert counts.trainable == formula and counts.trainable_bytes == 4 * formula
  assert counts.total == plain.total + formula and plain.trainable == plain.total
  assert counts.frozen_bytes == 4 * plain.total and plain.frozen_bytes == 0


def _saved_token_residuals(cfg, states, capsys):
  """Sorted widths of the [B*T, width] residuals the gradient of `cfg`'s model saves."""
  graphdef = _graphdef(cfg)

  def loss(*states):
    model = nnx.merge(graphdef, *states, copy=True)
    return jnp.sum(model.hidden_states(_tokens()) ** 2)
  with _one_device():
    jax.ad_checkpoint.print_saved_residuals(loss, *states)
  shapes = re.findall(rf"^f32\[{B * T},(\d+)\]", capsys.readouterr().out, re.MULTILINE)
  return sorted(int(w) for w in shapes)


def test_minimal_remat_saves_no_adapter_update(capsys):
  """`minimal` saves the projections' outputs; under LoRA only the [.., R] adapter inputs are
  added, not the [.., O] updates (as large as the projections)."""
  plain = BASE.replace(num_layers=1, scan_layers=False, remat_policy="minimal")
  cfg = _lora(plain, rank=4)
  graphdef, params = _init_plain(plain)
  _, adapters, frozen = _lora_model(cfg, params, random_b=True)
  want = _saved_token_residuals(plain, (params,), capsys)
  got = _saved_token_residuals(cfg, (adapters, frozen), capsys)
  assert want == [32, 32, 64, 64, 128, 128]  # outputs of k, v, q, o, gate, up
  assert got == sorted(want + [4] * 7), got


# --------------------------------------------------------------------------------------------
# The quantized base in the model (the quantization itself: tests/test_quantize.py).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, ratio", [("nf4", (0.5 + 4 / 64) / 4), ("int8", (1 + 4 / 64) / 4),
                                           ("int4", (0.5 + 4 / 64) / 4)])
def test_qlora_model_close_to_base_and_small(scheme, ratio):
  graphdef, params = _base()
  cfg = _lora(quant=scheme, group=64)
  want = _logits(graphdef, (params,), _tokens())
  lgraphdef, adapters, frozen = _lora_model(cfg, params)
  got = _logits(lgraphdef, (adapters, frozen), _tokens())
  err = float(jnp.max(jnp.abs(got - want)))
  rel = float(jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean((want - want.mean()) ** 2)))
  # Bytes of the quantized projections vs the same weights in float32.
  stored = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(nnx.state(frozen,
                                                                              quantize.Quantized)))
  weights = sum(v.size for p, v in _flat(params).items() if "'attn'" in p or "'mlp'" in p)
  print(f"\n{scheme}: logits max abs error {err:.2e}, relative RMS {rel:.3f} "
        f"(logits std {float(want.std()):.3f}); projections {stored} bytes vs "
        f"{4 * weights} float32 ({stored / (4 * weights):.4f})")
  assert stored == pytest.approx(ratio * 4 * weights)  # 4 scale bytes per 64 weights
  # About the weights' own relative error (round-trip test): 0.006 int8, 0.09-0.11 4-bit.
  assert rel < {"int8": 0.02, "int4": 0.2, "nf4": 0.2}[scheme]
  # The QLoRA state merges back to the dequantized base (adapters still zero).
  merge = lambda a, f: peft_state.merged_params(nnx.merge(lgraphdef, a, f))
  merged = jax.jit(merge)(adapters, frozen)
  np.testing.assert_allclose(np.asarray(_logits(graphdef, (merged,), _tokens())),
                             np.asarray(got), atol=1e-5)


def test_frozen_from_base_rejects_another_layout():
  _, unrolled = _base(scan_layers=False)
  with pytest.raises(ValueError, match=r"not those of the plain model \(scan_layers=True\)"):
    peft_state.frozen_from_base(unrolled, _lora())


# --------------------------------------------------------------------------------------------
# Dropout.
# --------------------------------------------------------------------------------------------


def test_dropout_is_keyed_and_only_on_the_adapter_path():
  cfg = _lora(dropout=0.5)
  graphdef, adapters, frozen = _lora_model(cfg, _base()[1], random_b=True)
  key, other = jax.random.key(7), jax.random.key(8)
  no_key = _logits(graphdef, (adapters, frozen), _tokens())
  keyed = _logits(graphdef, (adapters, frozen), _tokens(), key)
  # Without a key: exactly the model without dropout.
  no_dropout_graphdef = _graphdef(_lora(dropout=0.0))  # = _lora(): compiled by other tests
  np.testing.assert_array_equal(no_key, _logits(no_dropout_graphdef, (adapters, frozen),
                                                _tokens()))
  np.testing.assert_array_equal(keyed, _logits(graphdef, (adapters, frozen), _tokens(), key))
  assert float(jnp.max(jnp.abs(keyed - no_key))) > 1e-3
  assert float(jnp.max(jnp.abs(keyed - _logits(graphdef, (adapters, frozen), _tokens(),
                                               other)))) > 1e-3
  # With B = 0 the adapter path adds nothing, so a key changes nothing: the base is untouched.
  _, zero_b, _ = _lora_model(cfg, _base()[1])
  np.testing.assert_array_equal(_logits(graphdef, (zero_b, frozen), _tokens(), key),
                                _logits(graphdef, (zero_b, frozen), _tokens()))


def test_dropout_same_under_unrolled_layers_and_remat():
  cfg = _lora(dropout=0.5)
  graphdef, adapters, frozen = _lora_model(cfg, _base()[1], random_b=True)
  key = jax.random.key(3)
  want = _logits(graphdef, (adapters, frozen), _tokens(), key)
  # Unrolled: layer i gets the same key as scan's step i.
  ucfg = cfg.replace(scan_layers=False, remat_policy="full")
  with _one_device():
    ugraphdef, *abstract = nnx.split(nnx.eval_shape(lambda: Decoder(ucfg, rngs=nnx.Rngs(0))),
                                     lora_lib.Adapter, ...)
  unrolled = []
  for state, target in zip((adapters, frozen), abstract):
    pure = nnx.to_pure_dict(state)
    pure["layers"] = {i: jax.tree.map(lambda x, i=i: x[i], pure["layers"]) for i in range(2)}
    nnx.replace_by_pure_dict(target, pure)
    unrolled.append(target)
  got = _logits(ugraphdef, tuple(unrolled), _tokens(), key)
  np.testing.assert_allclose(got, want, atol=1e-5)
  # Remat (scanned) with the keys passed through: the same numbers.
  rgraphdef = _graphdef(cfg.replace(remat_policy="minimal"))
  np.testing.assert_allclose(_logits(rgraphdef, (adapters, frozen), _tokens(), key), want,
                             atol=1e-6)


# --------------------------------------------------------------------------------------------
# Sharding.
# --------------------------------------------------------------------------------------------


def _assert_valid_shardings(cfg, mesh):
  _, abstract, shardings = abstract_model(cfg, mesh)
  for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(abstract),
                          jax.tree.leaves(shardings)):
    s.shard_shape(a.shape)  # raises when a sharded dim does not divide evenly
  return abstract


@pytest.mark.parametrize("scheme", ["none", "nf4"])
def test_sharded_forward_matches_one_device(scheme):
  cfg = _lora(quant=scheme)
  mesh = mesh_of((2, 2, 2))
  abstract = _assert_valid_shardings(cfg, mesh)
  layers = abstract["layers"]
  if scheme == "nf4":
    assert layers["attn"]["wq_DHE"]["codes"].sharding.spec == P("stage", ("fsdp", "context", "expert"), "tensor", None)
    assert layers["mlp"]["w_down_FD"]["scales"].sharding.spec == P("stage", "tensor", ("fsdp", "context", "expert"))
  assert layers["attn"]["lora_o"]["a_IR"].sharding.spec == P("stage", "tensor", None, None)
  assert layers["mlp"]["lora_gate"]["b_RO"].sharding.spec == P("stage", None, "tensor")
  assert peft_state.check_mesh(cfg, mesh)

  graphdef, adapters, frozen = _lora_model(cfg, _base()[1], random_b=True)
  tokens = np.concatenate([_tokens(0), _tokens(1)])  # batch 4: splits over (data, fsdp)
  want = _logits(graphdef, (adapters, frozen), tokens)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_RULES):
    _, abstract_adapters, abstract_frozen = nnx.split(
        nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), lora_lib.Adapter, ...)
    adapter_shardings = nnx.get_named_sharding(abstract_adapters, mesh)
    frozen_shardings = nnx.get_named_sharding(abstract_frozen, mesh)
  host = lambda state: jax.tree.map(np.asarray, state)  # noqa: E731  (off device 0)
  with jax.set_mesh(mesh):
    frozen = jax.jit(peft_state.frozen_from_base, static_argnums=1,
                     out_shardings=frozen_shardings)(host(_base()[1]), cfg)
    adapters = jax.device_put(host(adapters), adapter_shardings)
    got = _logits(graphdef, (adapters, frozen), tokens)
  for var, s in zip(jax.tree.leaves(frozen), jax.tree.leaves(frozen_shardings)):
    assert var.sharding.is_equivalent_to(s, var.ndim)
  print(f"\n{scheme} on (2,2,2) vs 1 device: max abs logit difference "
        f"{float(np.max(np.abs(np.asarray(got) - np.asarray(want)))):.1e}")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_mesh_too_wide_for_the_groups_is_named():
  cfg = _lora(quant="nf4", group=64)  # D=64: one group along embed
  with pytest.raises(ValueError, match=r"quant_group_size=64: .*fsdp.*use "
                                       r"lora.quant_group_size=8"):
    peft_state.check_mesh(cfg, mesh_of((1, 8, 1)))


def _config_file(name, **lora):
  config = load_config_file(os.path.join(REPO, "configs", f"{name}.py"))
  config.attention.impl = "xla"
  for k, v in lora.items():
    setattr(config.lora, k, v)
  return ModelConfig.from_config(config, platform="gpu")


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1)])
def test_tiny_config_shardings(mesh_shape):
  cfg = _config_file("tiny", rank=8, quantize_base="nf4", quant_group_size=16)
  _assert_valid_shardings(cfg, mesh_of(mesh_shape))
  peft_state.check_mesh(cfg, mesh_of(mesh_shape))


def test_llama8b_qlora_sizes_and_shardings():
  cfg = _config_file("llama8b", rank=16, quantize_base="nf4", quant_group_size=64)
  counts = peft_state.parameter_counts(cfg)
  L, D, KE, F, r = 32, 4096, 8 * 128, 14336, 16
  trainable = L * r * (2 * (D + D) + 2 * (D + KE) + 3 * (D + F))
  quantized = L * (2 * D * D + 2 * D * KE + 3 * D * F)
  unquantized = 2 * 128256 * D + (2 * L + 1) * D  # embed, head, norms: float32
  assert counts.trainable == trainable == 41_943_040
  assert counts.quantized == quantized
  assert counts.frozen_bytes == quantized // 2 + quantized // 64 * 4 + 4 * unquantized
  assert counts.total == 8_030_261_248 + trainable
  print(f"\nllama8b r=16 all targets nf4/64: trainable {counts.trainable:,} "
        f"({counts.trainable_bytes:,} B), quantized {counts.quantized:,} params, frozen "
        f"{counts.frozen_bytes:,} B (of which codes+scales "
        f"{quantized // 2 + quantized // 64 * 4:,} B), total {counts.total:,}")
  for mesh_shape in [(1, 8, 1), (2, 2, 2)]:
    mesh = mesh_of(mesh_shape)
    peft_state.check_mesh(cfg, mesh)
    abstract = _assert_valid_shardings(cfg, mesh)
    per_device = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                     for a in jax.tree.leaves(abstract))
    print(f"  mesh {mesh_shape}: {per_device:,} B of params per device")
