"""DeepSeek-V3's router and its balancing (models/moe.py; configs/deepseek_tiny.py): the
correction biases move against the load after each step and are never changed by the
optimizer; the sequence-wise balance loss equals a per-row reference on any mesh; expert
parallelism equals one device with both on; bad settings are one-line errors."""

import os

import jax
from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import default_config
from jaxtrain.models import moe
from jaxtrain.parallel.expert_parallel import Sequences
from jaxtrain.train import setup as train_setup, loop as trainer
from tests.moe_helpers import on_short_rows, with_changes
from tests.helpers import (REPO, assert_curves_close, assert_one_line_config_error, mesh_of,
                           packed_batch)

DEEPSEEK_TINY = os.path.join(REPO, "configs", "deepseek_tiny.py")


def _deepseek_tiny(**mesh):
  return on_short_rows(DEEPSEEK_TINY, **mesh)


def test_biases_move_against_each_layers_load_error():
  params = {"layers": {"mlp": {"router_bias_X": jnp.zeros((2, 4)), "router_DX": jnp.ones(3)}}}
  load_LX = jnp.array([[5.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
  out = moe.balance_router_biases(params, load_LX, 0.01)
  # Layer 0: expert 0 took more than the mean (2) and goes down, the others up; layer 1 is
  # balanced and stays.
  np.testing.assert_array_equal(out["layers"]["mlp"]["router_bias_X"],
                                np.float32([[-0.01, 0.01, 0.01, 0.01], [0, 0, 0, 0]]))
  np.testing.assert_array_equal(out["layers"]["mlp"]["router_DX"], np.ones(3))
  with pytest.raises(ValueError, match="2 router bias rows for 3"):
    moe.balance_router_biases(params, jnp.ones((3, 4)), 0.01)


def _biases(state):
  return [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
          if moe.is_router_bias(path)]


def _train(config, shape, steps: int = 20):
  """(train_curves' {"loss", "grad_norm"}, [the routers' correction biases before each step and
  after the last], [each step's metrics]) of `steps` train steps of `config` on the mesh
  `shape`, on train_curves' batches, from the seed-0 init with every correction bias set to
  0.5: equal biases choose the experts zero biases do, and off zero AdamW's weight decay would
  move them."""
  setup = train_setup.build(config, mesh_of(shape))
  state = train_setup.init_state(setup, seed=0)
  state = state.replace(params=jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.full_like(x, 0.5) if moe.is_router_bias(path) else x, state.params))
  curves, biases, metrics = {"loss": [], "grad_norm": []}, [_biases(state)], []
  with jax.set_mesh(setup.mesh):
    for step in range(steps):
      batch = packed_batch(config.train.global_batch_size, config.train.seq_len,
                           config.model.vocab_size, seed=step, docs_per_row=3)
      state, step_metrics = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
      metrics.append(jax.device_get(step_metrics))
      biases.append(_biases(state))
      for key, values in curves.items():
        values.append(float(step_metrics[key]))
  return curves, biases, metrics


def _assert_biases_moved_by_the_rate(biases, metrics, rate):
  """Every step moved each bias by exactly -rate, 0 or +rate, some down and some up."""
  for step, (before, after, step_metrics) in enumerate(zip(biases, biases[1:], metrics)):
    assert moe.EXPERT_LOAD not in step_metrics and step_metrics["moe_seq_aux_loss"] > 0
    assert step == 0 or float(step_metrics["learning_rate"]) > 0
    # The three MoE layers' stack, then the multi-token-prediction module's MoE block.
    assert [b.shape for b in after] == [(3, 8), (8,)]
    before, after = (np.concatenate([b.reshape(-1, 8) for b in bs]) for bs in (before, after))
    moved = np.round((after - before) / rate)
    np.testing.assert_allclose(after - before, moved * rate, atol=1e-7, err_msg=f"step {step}")
    assert set(np.unique(moved)) <= {-1.0, 0.0, 1.0}, step
    assert np.any(moved == -1) and np.any(moved == 1), step


@pytest.mark.slow(seconds=50)
def test_biases_step_by_the_rate_and_expert_parallel_training_equals_one_device_for_20_steps():
  """Bias balancing and the sequence-wise loss on, one device and the experts split 2 ways
  beside data and tensor parallelism (the loads and the per-row statistics summed across all
  three), 20 steps each (one test: the one-device run serves both claims):

  - biases set to 0.5 move by exactly -rate, 0 or +rate per step, in both runs: AdamW's weight
    decay (or any update of the optimizer's) would put them off that grid (0.5 * lr * 0.1 =
    6e-6 at the second step's learning rate). The rate is deepseek_tiny's 0.01, not the
    default config's 0.001: the step uses the configured one.
  - float32 losses and gradient norms within 1e-5 of one device's at each of the 20 steps."""
  config = _deepseek_tiny()
  rate = config.moe.bias_update_rate
  assert rate == 0.01 != default_config().moe.bias_update_rate
  one_device, biases, metrics = _train(config, {})
  _assert_biases_moved_by_the_rate(biases, metrics, rate)
  mesh = dict(expert=2, data=2, tensor=2)
  expert_parallel, biases, metrics = _train(_deepseek_tiny(**mesh), mesh)
  _assert_biases_moved_by_the_rate(biases, metrics, rate)
  assert_curves_close(expert_parallel, one_device, rtol=1e-5)


def test_sequence_wise_balance_loss_equals_a_per_row_reference():
  rng = np.random.default_rng(0)
  rows, t, x, k = 3, 5, 8, 2
  logits_NX = jnp.asarray(rng.normal(size=(rows * t, x)), jnp.float32)
  routing = moe.Routing(num_experts=x, top_k=k, norm_topk_prob=True, capacity_factor=0.0,
                        activation="silu", matmul_impl="blocked", dtype="float32",
                        score="sigmoid", n_group=2, topk_group=1, sequence_balance=True)
  mask_N = jnp.asarray(rng.random(rows * t) > 0.2)

  @jax.jit
  def route_and_stats(logits_NX, mask_N):
    probs_NX, _, experts_NK = moe.route(logits_NX, routing)
    return probs_NX, experts_NK, moe.router_stats(
        logits_NX, probs_NX, experts_NK, mask_N, jnp.zeros(rows * t * k, bool),
        lambda tree: tree, Sequences(rows=rows))
  probs_NX, experts_NK, stats = route_and_stats(logits_NX, mask_N)
  want = []
  for r in range(rows):
    keep = np.asarray(mask_N).reshape(rows, t)[r]
    chosen = np.asarray(experts_NK).reshape(rows, t, k)[r][keep]
    scores = np.asarray(probs_NX).reshape(rows, t, x)[r][keep]
    f = x / (k * keep.sum()) * np.bincount(chosen.ravel(), minlength=x)
    want.append(np.sum(f * scores.mean(axis=0)))
  assert float(stats["sequences"]) == rows
  np.testing.assert_allclose(float(stats["seq_aux_sum"]) / rows, np.mean(want), rtol=1e-6)


@pytest.mark.parametrize("changes,words", [
    ({"moe.n_group": 3}, ["moe.n_group=3", "moe.num_experts=8"]),
    ({"moe.topk_group": 5}, ["moe.topk_group=5", "moe.n_group=4"]),
    ({"moe.n_group": 8, "moe.topk_group": 1}, ["moe.experts_per_token=2", "raise moe.topk_group"]),
    ({"moe.bias_update_rate": -0.1}, ["moe.bias_update_rate=-0.1", ">= 0"]),
    ({"moe.seq_aux_loss_coef": -1.0}, ["moe.seq_aux_loss_coef=-1.0", ">= 0"]),
    ({"moe.router_score": "tanh"}, ["moe.router_score='tanh'", "sigmoid"]),
    ({"model.qk_rope_head_dim": 32}, ["model.qk_rope_head_dim=32", "model.head_dim=32"]),
    ({"model.v_head_dim": 64}, ["model.v_head_dim=64", "model.head_dim=32"]),
    ({"model.num_kv_heads": 2}, ["model.num_kv_heads=2", "model.num_heads=4"]),
    ({"model.sliding_window": 16}, ["model.sliding_window=16", "latent attention"]),
    ({"model.kv_lora_rank": 0}, ["model.q_lora_rank=48", "model.kv_lora_rank=0"]),
])
def test_bad_deepseek_settings_are_one_line_errors(changes, words):
  assert_one_line_config_error(with_changes(_deepseek_tiny(), changes), 1, words)


@pytest.fixture(scope="module")
def two_depths():
  """deepseek_tiny's model with two prediction modules, and its forward jitted once."""
  from jaxtrain.models.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.sharding import create_model  # pylint: disable=import-outside-toplevel
  c = _deepseek_tiny()
  c.model.mtp_depth = 2
  model = create_model(ModelConfig.from_config(c, platform="cpu"), mesh_of({}), seed=0)
  # Eagerly first, on the weights as created (sharded): the unscanned modules' MoE blocks run
  # outside jit; the jitted forward must agree.
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 24)), jnp.int32)
  eager = np.asarray(model.hidden_states_with_predictions(tokens)[1][0])
  forward = nnx.jit(type(model).hidden_states_with_predictions)
  np.testing.assert_allclose(np.asarray(forward(model, tokens)[1][0]), eager, atol=1e-5)
  return c, model, forward


@pytest.mark.parametrize("q_lora_rank,yarn", [(48, False), (0, True)])
def test_generation_from_the_latent_cache_equals_the_forward_pass(q_lora_rank, yarn, request):
  """A 10-token prefill, then one token at a time from the cache of latents and RoPE keys,
  gives the full forward's float32 logits at every position (with and without the query
  bottleneck; YaRN's softmax scale on the absorbed path too). With the bottleneck: the
  two-depth model of the prediction tests (deepseek_tiny's, whose prediction modules
  generation leaves out)."""
  from jaxtrain.models.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.sharding import create_model  # pylint: disable=import-outside-toplevel
  if (q_lora_rank, yarn) == (48, False):
    c, model, _ = request.getfixturevalue("two_depths")
    assert c.model.q_lora_rank == 48 and c.model.rope_scaling.type != "yarn"
  else:
    c = _deepseek_tiny()
    c.model.q_lora_rank = q_lora_rank
    if yarn:
      y = c.model.rope_scaling
      y.type, y.factor, y.original_max_position_embeddings = "yarn", 4.0, 16
      y.beta_fast, y.beta_slow, y.mscale, y.mscale_all_dim = 32.0, 1.0, 1.0, 0.707
    model = create_model(ModelConfig.from_config(c, platform="cpu"), mesh_of({}), seed=0)
  assert set(model.empty_cache(2, 24)) == {"latent", "k_rope"}
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)
  want = np.asarray(nnx.jit(type(model).__call__)(model, tokens))
  step = nnx.jit(type(model).forward_with_cache)
  logits, cache = step(model, tokens[:, :10], jnp.zeros(2, jnp.int32), model.empty_cache(2, 24))
  got = [np.asarray(logits)]
  for i in range(10, 24):
    logits, cache = step(model, tokens[:, i:i + 1], jnp.full(2, i, jnp.int32), cache)
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-5, rtol=0)


def test_each_prediction_depth_sees_one_more_token_and_no_later_one(two_depths):
  """Depth k's state at position t combines the main model's state at t with token t + k: it
  changes when token t + k does and not for any later token (in the main model, position t
  sees tokens up to t only)."""
  _, model, forward = two_depths
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 24)), jnp.int32)
  changed = tokens.at[:, 12].set((tokens[:, 12] + 1) % 256)
  main, states = forward(model, tokens)
  main2, states2 = forward(model, changed)
  np.testing.assert_allclose(np.asarray(main), np.asarray(nnx.jit(type(model).hidden_states)(
      model, tokens)), atol=1e-6)
  for k, (a, b) in enumerate(zip(states, states2), start=1):
    differs = np.abs(np.asarray(a) - np.asarray(b)).max(axis=(0, 2)) > 1e-6
    # The first position that sees token 12 at depth k is 12 - k.
    assert not differs[:12 - k].any() and differs[12 - k], (k, np.flatnonzero(differs))
  assert not (np.abs(np.asarray(main) - np.asarray(main2)).max(axis=(0, 2))[:12] > 1e-6).any()


def test_prediction_losses_are_each_depths_cross_entropy_within_documents(two_depths):
  """mtp_loss (and the loss's extra weight/D times the depths' sum) from dense logits of each
  depth's states against the targets k places on, masked where they leave the document."""
  from jaxtrain.objectives.forward import loss_sum_fn  # pylint: disable=import-outside-toplevel
  c, model, forward = two_depths
  batch = {k: jnp.asarray(v) for k, v in packed_batch(4, 32, 256, seed=3).items()}
  graphdef, params = nnx.split(model)
  # Training's loss and the loss without training's terms, in one program.
  losses = jax.jit(lambda p, b: tuple(loss_sum_fn(p, graphdef, b, 32, training=training)
                                      for training in (True, False)))
  (loss_sum, count, metrics), (without, _, _) = losses(params, batch)
  _, states = forward(model, batch["inputs"], batch["positions"], batch["segment_ids"])
  w = np.asarray(model.head_DV[...], np.float64)
  targets, mask, seg = (np.asarray(batch[k]) for k in ("targets", "loss_mask", "segment_ids"))
  means = []
  for k, h in enumerate(states, start=1):
    logits = np.asarray(h, np.float64) @ w
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    total = n = 0.0
    for b in range(4):
      for t in range(32 - k):
        if mask[b, t + k] and seg[b, t + k] == seg[b, t]:
          total -= logp[b, t, targets[b, t + k]]
          n += 1
    assert 0 < n < mask.sum()  # documents end inside the rows: some targets are left out
    means.append(total / n)
  np.testing.assert_allclose(float(metrics["mtp_loss"]) / float(count), np.mean(means),
                             rtol=2e-5)
  router = float(metrics["moe_seq_aux_loss"]) / float(count) * c.moe.seq_aux_loss_coef
  np.testing.assert_allclose((float(loss_sum) - float(without)) / float(count),
                             c.model.mtp_loss_weight / 2 * sum(means) + router, rtol=1e-4)


@pytest.mark.parametrize("changes,words", [
    ({"model.family": "mixtral", "moe.router_score": "softmax", "moe.router_bias": False,
      "moe.n_group": 1, "moe.topk_group": 1, "model.kv_lora_rank": 0, "model.q_lora_rank": 0,
      "model.qk_rope_head_dim": 0, "model.v_head_dim": 0, "model.num_kv_heads": 2},
     ["model.mtp_depth=1", "model.family='mixtral'", "deepseek_v3"]),
    ({"train.objective": "dpo", "data.format": "preference", "data.source": "jsonl"},
     ["model.mtp_depth=1", "train.objective='dpo'"]),
    ({"model.mtp_depth": -1}, ["model.mtp_depth=-1", ">= 0"]),
    ({"model.mtp_loss_weight": -0.5}, ["model.mtp_loss_weight=-0.5", ">= 0"]),
])
def test_bad_prediction_settings_are_one_line_errors(changes, words):
  assert_one_line_config_error(with_changes(_deepseek_tiny(), changes), 1, words)


