"""Model families: each is the shared decoder with a few switches (jaxtrain/models/), and each
switch does what it should where it matters: decoding equals the forward pass (past the sliding
window, with both layer types in a scanned stack), scanned equals unrolled, the window is exactly
W keys, counts come from the model, training matches across meshes, LoRA and DPO train.
(Parity with transformers: tests/test_hf_families.py; Gemma 3's two layer types compiled with our
Pallas kernels by the GPU and TPU compilers: tests/test_targets.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import cost, registry
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model, create_model
from jaxtrain.train import setup as train_setup, loop as trainer
from tests.helpers import (FAMILY_OVERRIDES, assert_curves_close, dpo_pair_batch, family_config,
                           lora_config, mesh_of, packed_batch, small_config,
                           train_curves)

FAMILIES = tuple(FAMILY_OVERRIDES)


def _model(family, **overrides):
  cfg = ModelConfig.from_config(family_config(family, **overrides), platform="cpu")
  return create_model(cfg, mesh_of((1, 1, 1)), seed=0)


# The model's logits as one compiled program (called eagerly, each of its operations would
# compile on its own).
_forward = nnx.jit(lambda model, tokens: model(tokens))


def _tokens(b=2, t=24, vocab=128, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


def test_every_family_is_registered_with_its_hf_names():
  # The Mixture-of-Experts families are tested in tests/test_moe*.py.
  assert set(registry.NAMES) == {"llama", *FAMILIES, "mixtral", "qwen3_moe", "deepseek_v3"}
  assert registry.for_hf_model_type("gemma3_text").name == "gemma3"
  assert registry.for_hf_model_type("gemma3").name == "gemma3"
  assert registry.for_hf_model_type("qwen3_moe").name == "qwen3_moe"
  assert registry.for_hf_model_type("deepseek_v3").name == "deepseek_v3"
  assert registry.for_hf_model_type("deepseek_v2") is None


# Scanned stacks for every family; unrolled layers (each with its static type) for Gemma 3.
@pytest.mark.parametrize("family,scan_layers", [(f, True) for f in FAMILIES] + [("gemma3", False)])
def test_decode_with_cache_equals_the_forward_pass(family, scan_layers):
  """A 10-token prefill then one token at a time reproduces the full forward's logits, 24 tokens
  long: past the 8-token window, through a stack of both layer types (Gemma 3)."""
  model = _model(family, scan_layers=scan_layers)
  tokens = _tokens()
  want = np.asarray(_forward(model, tokens))
  step = nnx.jit(type(model).forward_with_cache)  # two programs: the prefill and one token
  cache = model.empty_cache(2, 24)
  logits, cache = step(model, tokens[:, :10], jnp.zeros(2, jnp.int32), cache)
  got = [np.asarray(logits)]
  for i in range(10, 24):
    logits, cache = step(model, tokens[:, i:i + 1], jnp.full(2, i, jnp.int32), cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_scanned_stack_equals_unrolled_layers(family):
  """The scanned stack picks each layer's type at run time (a cond), unrolled layers hold it
  statically: the same params give the same logits."""
  scanned = _model(family)
  unrolled_cfg = scanned.cfg.replace(scan_layers=False)
  graphdef, params, _ = abstract_model(unrolled_cfg, mesh_of((1, 1, 1)))
  stacked = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
  layers = stacked.pop("layers")
  stacked["layers"] = {i: jax.tree.map(lambda x, i=i: x[i], layers)
                       for i in range(scanned.cfg.arch.num_layers)}
  nnx.replace_by_pure_dict(params, stacked)
  unrolled = nnx.merge(graphdef, params)
  tokens = _tokens()
  np.testing.assert_allclose(np.asarray(_forward(unrolled, tokens)),
                             np.asarray(_forward(scanned, tokens)),
                             atol=1e-5, rtol=0)


def test_a_sliding_window_of_w_sees_exactly_w_tokens():
  """Mistral (every layer sliding, window 8): logits at positions < 8 equal the windowless
  model's; from position 8 on, they differ, and a token 8 back no longer reaches the query."""
  windowed, full = _model("mistral"), _model("mistral", sliding_window=0)
  tokens = _tokens(t=20)
  a, b = np.asarray(_forward(windowed, tokens)), np.asarray(_forward(full, tokens))
  np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-5, rtol=0)
  assert np.abs(a[:, 8:] - b[:, 8:]).max() > 1e-3
  # With two layers a token reaches 2 * (8 - 1) = 14 positions ahead, not 15: changing token 0
  # moves position 14's logits but not position 15's.
  changed = tokens.at[:, 0].set((tokens[:, 0] + 1) % 128)
  c = np.asarray(_forward(windowed, changed))
  assert np.abs(c[:, 14] - a[:, 14]).max() > 1e-6
  np.testing.assert_array_equal(c[:, 15:], a[:, 15:])


@pytest.mark.parametrize("family", ("llama",) + FAMILIES)
def test_parameter_count_comes_from_the_model(family):
  config = family_config(family) if family != "llama" else small_config()
  cfg = ModelConfig.from_config(config, platform="cpu")
  _, params, _ = abstract_model(cfg, mesh_of((1, 1, 1)))
  assert sum(x.size for x in jax.tree.leaves(params)) == cost.param_count(cfg.arch)


def test_sliding_layers_are_credited_only_their_window_of_attention():
  """cost.keys_per_query is the mean number of visible keys, counted by brute force."""
  for t, w in [(32, 8), (32, 32), (32, 40), (7, 3)]:
    i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
    visible = (j <= i) & (i - j < w)
    assert cost.keys_per_query(t, w) == pytest.approx(visible.sum() / t if w < t else t / 2)
  assert cost.keys_per_query(32, None) == 16
  gemma = ModelConfig.from_config(family_config("gemma3"), platform="cpu").arch
  full = gemma.__class__(**{**gemma.__dict__, "sliding_window": 0})
  attention_saved = cost.flops_per_token(full, 32) - cost.flops_per_token(gemma, 32)
  # One of the two layers is sliding: 12 * H * E * (16 - keys_per_query(32, 8)).
  assert attention_saved == pytest.approx(12 * 8 * 8 * (16 - cost.keys_per_query(32, 8)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_training_matches_across_meshes(family):
  """Three optimizer steps on data x fsdp x tensor = 2x2x2 follow the single-device run: float32
  losses and gradient norms within 1e-5 at every step."""
  config = family_config(family)
  runs = {shape: train_curves(config, shape, steps=3, docs_per_row=2)
          for shape in [(1, 1, 1), (2, 2, 2)]}
  assert_curves_close(runs[(2, 2, 2)], runs[(1, 1, 1)], rtol=1e-5)


@pytest.mark.slow
def test_lora_and_dpo_train_a_non_llama_model():
  """Gemma 3 under LoRA: only adapters change and the loss falls; Qwen3 DPO under LoRA starts at
  log 2 (the base is the reference) and improves."""
  config = lora_config(family="gemma3")
  setup = train_setup.build(config, mesh_of((1, 1, 1)))
  state = train_setup.init_state(setup, seed=0)
  frozen = jax.device_get(state.frozen)
  batch = packed_batch(8, 32, 128)
  losses = []
  with jax.set_mesh(setup.mesh):
    for _ in range(6):
      state, m = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
      losses.append(float(m["loss"]))
  assert losses[-1] < losses[0] - 0.1, losses
  for before, after in zip(jax.tree.leaves(frozen), jax.tree.leaves(state.frozen)):
    np.testing.assert_array_equal(before, jax.device_get(after))

  config = lora_config(objective="dpo", family="qwen3")
  setup = train_setup.build(config, mesh_of((1, 1, 1)))
  state = train_setup.init_state(setup, seed=0)
  batch = dpo_pair_batch()
  losses = []
  with jax.set_mesh(setup.mesh):
    for _ in range(6):
      state, m = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
      losses.append(float(m["loss"]))
  assert losses[0] == pytest.approx(np.log(2), abs=1e-6)
  assert losses[-1] < losses[0] and float(m["reward_accuracy"]) > 0.5
