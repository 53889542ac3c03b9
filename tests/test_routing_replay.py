"""Routing replay for MoE policies (grpo.replay_routing): the router uses recorded experts where
given, the rollouts record every token's experts in every layer at the positions a training row
has them, the replayed forward pass of a row equals the free one when nothing differs, and in
bfloat16, where the decode loop and the training pass round differently, replay shrinks the
gap between the sampler's and the trainer's log-probs; and in GRPO and PPO runs whose sampler
routes every token elsewhere than the trainer's router would, replay alone closes it."""

import json
import os

import jax
from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import load_config_file
from jaxtrain.generate import sampler as generate
from jaxtrain.models import moe
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import create_model
from jaxtrain.objectives.grpo import loss as grpo
from jaxtrain.objectives.grpo.rollouts import completion_lengths, training_rows
from tests.helpers import REPO, assert_one_line_config_error, mesh_of, run_cli


def test_the_router_uses_the_recorded_experts_and_their_own_weights():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, 6)), jnp.float32)
  routing = moe.Routing(num_experts=6, top_k=2, norm_topk_prob=True, capacity_factor=0.0,
                        activation="silu", matmul_impl="blocked", dtype="float32")
  _, free_w, free_e = moe.route(logits, routing)
  forced = jnp.asarray([[5, 0], [-1, -1], [2, 3]], jnp.int32)
  _, weights, experts = moe.route(logits, routing, forced_NK=forced)
  np.testing.assert_array_equal(experts[0], [5, 0])
  np.testing.assert_array_equal(experts[1], free_e[1])  # nothing recorded: its own choice
  np.testing.assert_array_equal(experts[2], [2, 3])
  probs = np.exp(np.asarray(logits, np.float64))
  probs /= probs.sum(-1, keepdims=True)
  for i, chosen in ((0, [5, 0]), (2, [2, 3])):
    want = probs[i, chosen] / probs[i, chosen].sum()
    np.testing.assert_allclose(weights[i], want, rtol=1e-5)
  np.testing.assert_allclose(weights[1], free_w[1], rtol=1e-6)


def _moe_model(scan_layers: bool):
  cfg = ModelConfig.of(family="mixtral", vocab_size=64, num_layers=3, d_model=32, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64, max_position_embeddings=64,
                       num_experts=4, experts_per_token=2, expert_mlp_dim=32, remat_policy="none",
                       scan_layers=scan_layers, attention_impl="xla", init_std=0.5)
  return create_model(cfg, mesh_of({}), seed=1)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_rollouts_recorded_routing_replays_into_the_training_row(scan_layers):
  model = _moe_model(scan_layers)
  prompt_BP = jnp.asarray([[1, 5, 9, 0, 0], [1, 7, 3, 8, 2], [1, 4, 0, 0, 0], [1, 2, 3, 4, 0]],
                          jnp.int32)
  lengths_B = jnp.asarray([3, 5, 2, 4], jnp.int32)
  sampling = generate.SamplingConfig(max_new_tokens=6, temperature=1.0, eos_id=None)
  tokens, _, routing_LBSK = jax.jit(
      lambda m, p, n, k: generate.sample_continuations(m, p, n, k, sampling, with_logprobs=True,
                                                       with_routing=True))(
      model, prompt_BP, lengths_B, jax.random.key(0))
  assert routing_LBSK.shape == (3, 4, 11, 2)
  tokens_BN = np.asarray(tokens)
  rows = training_rows(np.asarray(prompt_BP), np.asarray(lengths_B), tokens_BN,
                       completion_lengths(tokens_BN, None), 16,
                       routing_BSLK=np.transpose(np.asarray(routing_LBSK), (1, 2, 0, 3)))
  routing_BTLK = rows["routing"]
  real_BT = rows["segment_ids"] > 0
  assert (routing_BTLK[real_BT] >= 0).all() and (routing_BTLK[~real_BT] == -1).all()

  @nnx.jit
  def forward(model, inputs, positions, segment_ids, routing_LBTK):
    kwargs = {} if routing_LBTK is None else {"routing_LBTK": routing_LBTK}
    x = model.hidden_states(inputs, positions, segment_ids, **kwargs)
    return jnp.einsum("BTD,DV->BTV", x, model.head_weights())

  def logits(routing_BTLK):
    routing_LBTK = None if routing_BTLK is None else jnp.moveaxis(jnp.asarray(routing_BTLK), 2, 0)
    return np.asarray(forward(model, jnp.asarray(rows["inputs"]), jnp.asarray(rows["positions"]),
                              jnp.asarray(rows["segment_ids"]), routing_LBTK))[real_BT]
  free = logits(None)
  # On CPU in float32 the decode loop routes as the training pass does: replaying the record
  # changes nothing.
  np.testing.assert_allclose(logits(routing_BTLK), free, rtol=1e-5, atol=1e-5)
  # Replaying other experts (each token's pair swapped for the two others) changes the output.
  other = np.where(routing_BTLK >= 0, (routing_BTLK + 2) % 4, -1)
  replayed_other = logits(other)
  assert np.abs(replayed_other - free).max() > 1e-2
  if not scan_layers:
    return
  # With the experts split over devices (each device's tokens go to their experts' devices and
  # back), the replayed experts travel with their tokens: the one-device numbers.
  mesh = mesh_of({"expert": 2, "fsdp": 2})
  sharded = create_model(model.cfg, mesh, seed=1)
  with jax.set_mesh(mesh):
    x = jax.jit(lambda m, i, p, s, r: m.hidden_states(i, p, s, routing_LBTK=r))(
        sharded, jnp.asarray(rows["inputs"]), jnp.asarray(rows["positions"]),
        jnp.asarray(rows["segment_ids"]), jnp.moveaxis(jnp.asarray(other), 2, 0))
    got = np.asarray(jnp.einsum("BTD,DV->BTV", x, sharded.head_weights()))[real_BT]
  # (Sums in another order over the shards: float32 rounding of logits of size ~1.)
  np.testing.assert_allclose(got, replayed_other, rtol=1e-4, atol=1e-4)


def test_replay_with_a_dense_policy_is_a_one_line_error():
  config = load_config_file(os.path.join(REPO, "configs", "grpo_tiny.py"))
  config.grpo.replay_routing = True
  assert_one_line_config_error(config, 1, ["grpo.replay_routing=True", "moe.num_experts=0"])


def test_replay_shrinks_the_bfloat16_logprob_mismatch_of_an_moe_policy():
  """bfloat16 compute: the decode loop (one token against the cache) and the training pass (the
  whole row) round differently, so a token whose best experts nearly tie can route differently
  in each, and its log-prob then differs by far more than rounding. Replay removes those cases;
  what is left is the rest of the model's rounding."""
  model = create_model(ModelConfig.of(
      family="mixtral", vocab_size=64, num_layers=3, d_model=32, num_heads=4, num_kv_heads=2,
      head_dim=8, mlp_dim=64, max_position_embeddings=64, num_experts=8, experts_per_token=2,
      expert_mlp_dim=32, remat_policy="none", attention_impl="xla", init_std=0.5,
      dtype="bfloat16"), mesh_of({}), seed=1)
  rng = np.random.default_rng(0)
  prompt_BP = rng.integers(1, 64, (64, 6)).astype(np.int32)
  lengths_B = rng.integers(2, 7, 64).astype(np.int32)
  sampling = generate.SamplingConfig(max_new_tokens=8, temperature=1.0)
  tokens, sampler_BN, routing_LBSK = jax.jit(
      lambda m, p, n, k: generate.sample_continuations(m, p, n, k, sampling, with_logprobs=True,
                                                       with_routing=True))(
      model, prompt_BP, lengths_B, jax.random.key(0))
  tokens_BN = np.asarray(tokens)
  rows = training_rows(prompt_BP, lengths_B, tokens_BN, completion_lengths(tokens_BN, None), 16,
                       np.asarray(sampler_BN), np.transpose(np.asarray(routing_LBSK), (1, 2, 0, 3)))
  mask_BT = rows["loss_mask"] > 0
  gaps = {}
  logprobs = nnx.jit(lambda model, batch: grpo.token_logprobs(model, batch, chunk_size=16))
  for replay in (False, True):
    keys = grpo.TOKEN_KEYS + ((grpo.ROUTING,) if replay else ())
    trained_BT = logprobs(model, {k: jnp.asarray(rows[k]) for k in keys})
    gaps[replay] = np.abs(np.asarray(trained_BT) - rows[grpo.SAMPLER_LOGPROBS])[mask_BT]
  assert gaps[False].max() > 0.1  # some tokens routed differently (4.3 here)
  assert gaps[True].max() < 0.5 * gaps[False].max(), (gaps[True].max(), gaps[False].max())
  assert gaps[True].mean() < gaps[False].mean()


MOE_SMALL = ["--config.model.family=mixtral", "--config.moe.num_experts=4",
             "--config.moe.experts_per_token=2", "--config.moe.expert_mlp_dim=64",
             "--config.grpo.replay_routing=True", "--config.train.global_batch_size=8",
             "--config.grpo.max_new_tokens=8", "--config.train.seq_len=28",
             "--config.train.steps=4", "--config.train.log_every=1",
             "--config.train.eval_every=100", "--config.train.eval_batches=1"]


def _mismatch(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r["logprob_mismatch"] for r in map(json.loads, f) if "logprob_mismatch" in r]


@pytest.fixture
def sampler_routes_elsewhere(monkeypatch):
  """The rollouts' sampler sends every token of every layer to other experts than its router's
  top k: each one further, mod the expert count (still k distinct experts, weighted by the
  router's own probabilities for them). The training pass's router keeps choosing its top k, so
  it routes every token differently from the sampler unless it replays the sampler's record.
  Patched at trace time: `moe.route` forces the shifted experts while generate's
  sample_continuations (traced inside the rollouts' jit) runs. Returns {"shifted": how many
  router calls were traced shifted}."""
  traced = {"sampling": False, "shifted": 0}
  sample, route = generate.sample_continuations, moe.route

  def sampling(*args, **kwargs):
    traced["sampling"] = True
    try:
      return sample(*args, **kwargs)
    finally:
      traced["sampling"] = False

  def shifted_route(logits_NX, routing, bias_X=None, forced_NK=None):
    if traced["sampling"]:
      assert forced_NK is None  # the sampler never replays
      _, _, experts_NK = route(logits_NX, routing, bias_X)
      forced_NK = (experts_NK + 1) % routing.num_experts
      traced["shifted"] += 1
    return route(logits_NX, routing, bias_X, forced_NK)

  monkeypatch.setattr(generate, "sample_continuations", sampling)
  monkeypatch.setattr(moe, "route", shifted_route)
  return traced


@pytest.mark.slow(seconds=20)
def test_grpo_and_ppo_train_an_moe_policy_on_replayed_routing(tmp_path, sampler_routes_elsewhere):
  """Both objectives' paths: GRPO with two updates per batch of rollouts (the old log-probs'
  pass replays too) and PPO (its old log-probs and values, and each minibatch's pass). The
  sampler routes every token elsewhere than the trainer's router would (sampler_routes_elsewhere),
  so only replay brings the trainer's log-probs to the sampler's, to float32 round-off: with
  grpo.replay_routing=False the same runs log mismatches of 0.04-0.06."""
  for name, extra in (("grpo", ["--config.grpo.num_generations=4",
                                "--config.grpo.num_iterations=2"]),
                      ("ppo", ["--config.ppo.epochs=2", "--config.ppo.minibatches=2"])):
    workdir = tmp_path / name
    before = sampler_routes_elsewhere["shifted"]
    proc = run_cli(f"--config=configs/{name}_tiny.py", *MOE_SMALL, *extra, f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sampler_routes_elsewhere["shifted"] > before  # the sampler's routers were shifted
    found = _mismatch(workdir)
    assert len(found) == 4 and max(found) < 1e-4, found  # float32: round-off
