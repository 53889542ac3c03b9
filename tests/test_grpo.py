"""GRPO's advantages and loss against numpy written from the formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.objectives.grpo import loss as grpo


def _advantages_reference(rewards, g):
  out = []
  for group in np.asarray(rewards, np.float64).reshape(-1, g):
    if np.all(group == group[0]):
      out += [0.0] * g
    else:
      out += list((group - group.mean()) / (group.std(ddof=1) + 1e-6))
  return np.array(out)


def test_group_advantages_are_standardized_within_each_group():
  rewards = [1.0, 0.0, 0.5, 0.25, 0.3, 0.3, 0.3, 0.3, 0.0, 1.0, 1.0, 1.0]
  got = np.asarray(grpo.group_advantages(jnp.asarray(rewards), 4))
  np.testing.assert_allclose(got, _advantages_reference(rewards, 4), rtol=1e-5, atol=1e-6)
  assert np.all(got[4:8] == 0.0)  # equal rewards: no signal, exactly 0
  with pytest.raises(ValueError, match="at least 2"):
    grpo.group_advantages(jnp.ones(4), 1)
  with pytest.raises(ValueError, match=r"expected \[N\*3\]"):
    grpo.group_advantages(jnp.ones(4), 3)


def _loss_reference(lp, old, ref, adv, mask, eps, beta):
  lp, old, ref, adv, mask = (np.asarray(x, np.float64) for x in (lp, old, ref, adv, mask))
  ratio = np.exp(lp - old)
  unclipped, clipped = ratio * adv[:, None], np.clip(ratio, 1 - eps, 1 + eps) * adv[:, None]
  kl = np.exp(ref - lp) - (ref - lp) - 1
  token = -np.minimum(unclipped, clipped) + beta * kl
  def seq_mean(x):
    return (x * mask).sum(1) / np.maximum(mask.sum(1), 1)
  return (seq_mean(token).mean(), seq_mean(kl).mean(),
          seq_mean((clipped < unclipped).astype(np.float64)).mean())


def test_grpo_loss_matches_the_formula_and_its_metrics():
  rng = np.random.default_rng(0)
  b, t = 6, 7
  lp = rng.normal(-2.0, 0.5, (b, t))
  old = lp + rng.normal(0.0, 0.3, (b, t))  # ratios well outside 1 ± 0.2 for some tokens
  ref = lp + rng.normal(0.0, 0.2, (b, t))
  adv = rng.normal(0.0, 1.0, b)
  mask = (rng.random((b, t)) < 0.7).astype(np.float32)
  mask[0] = 0.0  # a sequence without completion tokens counts as 0, not NaN
  loss, metrics = grpo.grpo_loss(*(jnp.asarray(x, jnp.float32) for x in (lp, old, ref, adv, mask)),
                                 epsilon=0.2, beta=0.04)
  want_loss, want_kl, want_clip = _loss_reference(lp, old, ref, adv, mask, 0.2, 0.04)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["clip_fraction"]), want_clip, rtol=1e-6)
  assert 0.0 < want_clip < 1.0 and want_kl > 0.0


def test_at_the_sampling_policy_the_gradient_is_the_advantage_weighted_score():
  """ratio = 1 and reference = policy: the loss gradient per token is -A/|mask| (the policy
  gradient), and the KL term adds nothing."""
  lp = jnp.asarray([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
  adv = jnp.asarray([0.5, -1.5])
  mask = jnp.asarray([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
  grad = jax.grad(lambda x: grpo.grpo_loss(x, lp, lp, adv, mask)[0])(lp)
  want = -np.array([[0.5 / 2, 0.5 / 2, 0.0], [-1.5 / 3] * 3]) / 2  # mean over 2 sequences
  np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6)


def test_sums_over_halves_add_up_to_the_whole_batch():
  rng = np.random.default_rng(1)
  args = [jnp.asarray(rng.normal(-1.0, 0.3, (4, 5)), jnp.float32) for _ in range(3)]
  adv = jnp.asarray(rng.normal(size=4), jnp.float32)
  mask = jnp.asarray(rng.random((4, 5)) < 0.8, jnp.float32)
  whole = grpo.grpo_sums(*args, adv, mask)
  halves = [grpo.grpo_sums(*(a[s] for a in args), adv[s], mask[s])
            for s in (slice(0, 2), slice(2, 4))]
  np.testing.assert_allclose(float(halves[0][0] + halves[1][0]), float(whole[0]), rtol=1e-6)
  assert float(halves[0][1] + halves[1][1]) == float(whole[1]) == 4.0
  for k in grpo.METRIC_NAMES:
    np.testing.assert_allclose(float(halves[0][2][k] + halves[1][2][k]), float(whole[2][k]),
                               rtol=1e-6)


def test_logprob_mismatch_is_the_largest_gap_over_sampled_completion_tokens():
  rng = np.random.default_rng(2)
  trainer = rng.normal(-2.0, 0.5, (4, 6)).astype(np.float32)
  sampler = (trainer + rng.normal(0.0, 0.01, (4, 6))).astype(np.float32)
  mask = (rng.random((4, 6)) < 0.7).astype(np.float32)
  sampler[0, :] = np.nan  # a row without sampled tokens (a warm-up's) counts for nothing
  trainer[1, 0], mask[1, 0] = np.nan, 0.0  # garbage off the mask counts for nothing
  sampler[2, 1], mask[2, 1] = -50.0, 0.0  # nor does a large gap off the mask
  counted = (mask > 0) & ~np.isnan(sampler)
  want = np.abs(trainer - sampler)[counted].max()
  got = grpo.logprob_mismatch(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(mask))
  assert float(got) == pytest.approx(float(want), rel=1e-6)
  assert float(grpo.logprob_mismatch(jnp.asarray(trainer), jnp.full((4, 6), jnp.nan),
                                     jnp.asarray(mask))) == -np.inf
  # No gradient, and no NaN from the positions it leaves out.
  grad = jax.grad(lambda x: grpo.logprob_mismatch(x, jnp.asarray(sampler), jnp.asarray(mask)))(
      jnp.asarray(np.nan_to_num(trainer)))
  np.testing.assert_array_equal(np.asarray(grad), 0.0)
