"""PPO's math (jaxtrain/objectives/ppo/loss.py) against plain numpy loops written from the
formulas."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.objectives.ppo import loss as ppo


def _rows(seed, b=4, t=12):
  """Rows with one contiguous run of actions each (a prompt before, padding after), and one row
  without any action."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((b, t), np.float32)
  for i in range(b - 1):
    start = int(rng.integers(1, 5))
    end = int(rng.integers(start + 1, t + 1))
    mask[i, start:end] = 1
  draw = lambda scale: (rng.normal(size=(b, t)) * scale).astype(np.float32)
  return rng, mask, draw


def _numpy_gae(rewards, values, mask, gamma, lam):
  b, t = rewards.shape
  adv = np.zeros((b, t))
  for i in range(b):
    steps = np.flatnonzero(mask[i])
    running = 0.0
    for k in reversed(range(len(steps))):
      s = steps[k]
      next_value = values[i, steps[k + 1]] if k + 1 < len(steps) else 0.0
      delta = rewards[i, s] + gamma * next_value - values[i, s]
      running = delta + gamma * lam * running
      adv[i, s] = running
  return adv, (adv + values) * mask


def test_token_rewards_put_the_kl_penalty_on_every_action_and_the_reward_on_the_last():
  rng, mask, draw = _rows(0)
  old, ref = draw(1.0), draw(1.0)
  reward = rng.normal(size=mask.shape[0]).astype(np.float32)
  got = np.asarray(ppo.token_rewards(jnp.asarray(reward), old, ref, mask, kl_coef=0.05))
  want = -0.05 * (old - ref) * mask
  for i in range(mask.shape[0]):
    steps = np.flatnonzero(mask[i])
    if len(steps):
      want[i, steps[-1]] += reward[i]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert not got[-1].any()  # the row without actions


def test_gae_and_returns_match_the_recursion():
  rng, mask, draw = _rows(1)
  rewards, values = draw(1.0) * mask, draw(2.0)
  del rng
  for gamma, lam in [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)]:
    adv, ret = ppo.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    want_adv, want_ret = _numpy_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
  # γ = λ = 1: the advantage is the sum of the rewards still to come minus the value.
  adv, _ = ppo.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), 1.0, 1.0)
  to_come = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]
  np.testing.assert_allclose(adv, (to_come - values) * mask, rtol=1e-5, atol=1e-5)


def test_whitening_and_explained_variance():
  _, mask, draw = _rows(2)
  x, values = draw(3.0) + 5.0, draw(1.0)
  w = np.asarray(ppo.whiten(jnp.asarray(x), jnp.asarray(mask)))
  kept = mask > 0
  assert abs(w[kept].mean()) < 1e-5 and abs(w[kept].std() - 1) < 1e-4 and not w[~kept].any()
  returns = values + draw(0.5)
  got = float(ppo.explained_variance(jnp.asarray(values), jnp.asarray(returns), jnp.asarray(mask)))
  want = 1 - np.var((returns - values)[kept]) / np.var(returns[kept])
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert float(ppo.explained_variance(jnp.asarray(returns), jnp.asarray(returns),
                                      jnp.asarray(mask))) == 1.0


def test_the_clipped_policy_and_value_losses_match_the_formulas():
  _, mask, draw = _rows(3)
  logp, old_logp = draw(0.3) - 2, draw(0.3) - 2
  values, old_values, returns, adv = draw(1.0), draw(1.0), draw(1.0), draw(1.0)
  eps, eps_v, c_v = 0.2, 0.3, 0.5
  total, count, sums = ppo.ppo_sums(*map(jnp.asarray, (logp, values, old_logp, old_values, adv,
                                                       returns, mask)),
                                    epsilon=eps, value_clip=eps_v, vf_coef=c_v)
  ratio = np.exp(logp - old_logp)
  policy = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
  v_clip = old_values + np.clip(values - old_values, -eps_v, eps_v)
  value = 0.5 * np.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
  clipped = (np.clip(ratio, 1 - eps, 1 + eps) * adv < ratio * adv).astype(np.float32)
  per_seq = lambda x: np.array([(x[i] * mask[i]).sum() / max(mask[i].sum(), 1)
                                for i in range(mask.shape[0])])
  assert float(count) == mask.shape[0]
  np.testing.assert_allclose(total, per_seq(policy + c_v * value).sum(), rtol=1e-5)
  np.testing.assert_allclose(sums["value_loss"], per_seq(value).sum(), rtol=1e-5)
  np.testing.assert_allclose(sums["clip_fraction"], per_seq(clipped).sum(), rtol=1e-5)
  # At the sampling policy with the old values: ratio 1, nothing clipped, L_π = -Â.
  total, _, sums = ppo.ppo_sums(*map(jnp.asarray, (old_logp, old_values, old_logp, old_values,
                                                   adv, returns, mask)), vf_coef=0.0)
  np.testing.assert_allclose(total, per_seq(-adv).sum(), rtol=1e-5, atol=1e-6)
  assert float(sums["clip_fraction"]) == 0 and float(sums["value_clip_fraction"]) == 0


def test_a_value_head_sits_beside_the_vocabulary_head():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jaxtrain.models import cost  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxtrain.models.sharding import create_model  # pylint: disable=import-outside-toplevel
  from tests.helpers import mesh_of  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig.of(vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_position_embeddings=64, value_head=True)
  model = create_model(cfg, mesh_of((1, 1, 1)))
  params = nnx.state(model, nnx.Param)
  assert {"value_D1", "head_DV"} <= set(nnx.to_pure_dict(params))
  assert sum(x.size for x in jax.tree.leaves(params)) == cost.param_count(cfg.arch)
  ids = jnp.ones((2, 5), jnp.int32)
  assert model(ids).shape == (2, 5, 61)
  x = model.hidden_states(ids, jnp.broadcast_to(jnp.arange(5), (2, 5)), jnp.ones((2, 5), jnp.int32))
  assert model.values(x).shape == (2, 5)
