"""PPO's rollout preparation (jaxtrain/objectives/ppo/rollouts.py with the math of
jaxtrain/objectives/ppo/loss.py) against a plain-numpy reference written per completion token from
the PPO-for-language-models definitions, on hand-made rollouts: prompts of different lengths,
completions that stop at an early EOS (tokens sampled after it belong to no row), at the last token
or not at all.

The reference works on each completion's own tokens. The tests of the pure functions read the
training rows only through their documented layout (completion token k of a row whose prompt
has p tokens at row position p-1+k, checked against
jaxtrain.objectives.grpo.rollouts.training_rows); the test through the model does not use the layout
at all. For a row whose prompt has p tokens and whose completion is z[p], ..., z[p+c-1] (c counts
the EOS):

  old_k, ref_k  log π(z[p+k] | z[:p+k]): the policy's (reference's) logits at sequence position
                p+k-1, the softmax of logits / grpo.temperature over the tokenizer's ids
                (the distribution sampled from)
  V_k           the value head at sequence position p+k-1 (the state before action z[p+k])
  r_k           -kl_coef · (old_k − ref_k), plus the row's score R when k = c − 1
  A_k           δ_k + γλ·A_{k+1},  δ_k = r_k + γ·V_{k+1} − V_k,  V_c = 0, A_c = 0
  G_k           A_k + V_k
  Â_k           (A_k − mean A) / (std A + 1e-8), mean and (population) std over every completion
                token of the batch of rollouts

Checked by mutating the source in scratch runs: a one-position shift of the old values or the
old log-probs in the preparation, a score on the wrong token or row, a KL penalty one token off,
the value GAE bootstraps from one position off, whitening over the padding, and minibatches
that overlap, repeat an epoch's order or ignore the seed each fail the test of that piece (and
the through-the-model test for every mutation of the preparation's math)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxtrain.objectives.grpo.rollouts import completion_lengths, training_rows
from jaxtrain.objectives.ppo import loss as ppo

EOS = 2


def _reference_token_rewards(old_k, ref_k, score, kl_coef):
  r = np.array([-kl_coef * (o - f) for o, f in zip(old_k, ref_k)], np.float64)
  r[len(r) - 1] += score
  return r


def _reference_gae(r_k, v_k, gamma, lam):
  c = len(r_k)
  adv = np.zeros(c)
  running, next_value = 0.0, 0.0  # nothing after the last action
  for k in reversed(range(c)):
    delta = r_k[k] + gamma * next_value - v_k[k]
    running = delta + gamma * lam * running
    adv[k] = running
    next_value = v_k[k]
  return adv, adv + np.asarray(v_k, np.float64)


def _reference_whiten(adv_rows):
  flat = np.concatenate(adv_rows)
  mean = flat.mean()
  std = np.sqrt(((flat - mean) ** 2).mean())
  return [(a - mean) / (std + 1e-8) for a in adv_rows]


def _hand_made_rollouts():
  """Prompts of 3, 6, 1, 4, 2 and 5 tokens; completions of at most 5: an EOS second with tokens
  after it, no EOS, an EOS first (a one-token completion), an EOS last, an EOS third with
  another one after it, and an EOS fourth."""
  lengths = np.array([3, 6, 1, 4, 2, 5], np.int32)
  prompts = np.zeros((6, 6), np.int32)
  for i, p in enumerate(lengths):
    prompts[i, :p] = 10 + 10 * i + np.arange(p)
  tokens = np.array([[71, EOS, 72, 73, 74],
                     [81, 82, 83, 84, 85],
                     [EOS, 91, 92, 93, 94],
                     [101, 102, 103, 104, EOS],
                     [111, 112, EOS, 113, EOS],
                     [121, 122, 123, EOS, 124]], np.int32)
  return prompts, lengths, tokens


def _made_up_rows(seed=0):
  """The hand-made rollouts' training rows and [B, T] log-probs and values that are random at
  every position, the prompt's and the padding's included (whatever a forward pass leaves
  there), so that any value read outside the completion shows."""
  prompts, lengths, tokens = _hand_made_rollouts()
  clen = completion_lengths(tokens, EOS)
  np.testing.assert_array_equal(clen, [2, 5, 1, 5, 3, 4])
  rows = training_rows(prompts, lengths, tokens, clen, seq_len=12)
  rng = np.random.default_rng(seed)
  b, t = rows["targets"].shape
  old, ref = rng.normal(-3, 1, (b, t)), rng.normal(-3, 1, (b, t))
  values = rng.normal(0, 1, (b, t))
  scores = rng.normal(0, 1, b)
  return (lengths, tokens, clen, rows, *(x.astype(np.float32) for x in (old, ref, values, scores)))


def _per_token(x_BT, i, p, c):
  """Row i's completion tokens' entries of a [B, T] array in the rows' layout: the action at row
  position t is targets[t] (jaxtrain.objectives.grpo.rollouts.training_rows), so completion token k
  of a row whose prompt has p tokens is at row position p - 1 + k."""
  return np.asarray(x_BT[i, p - 1:p - 1 + c], np.float64)


def _check_layout(rows, lengths, tokens, clen):
  for i, (p, c) in enumerate(zip(lengths, clen)):
    assert np.flatnonzero(rows["loss_mask"][i]).tolist() == list(range(p - 1, p - 1 + c))
    np.testing.assert_array_equal(rows["targets"][i, p - 1:p - 1 + c], tokens[i, :c])


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_token_rewards_match_the_reference_per_completion_token(kl_coef):
  lengths, tokens, clen, rows, old, ref, _, scores = _made_up_rows()
  _check_layout(rows, lengths, tokens, clen)
  got = np.asarray(ppo.token_rewards(jnp.asarray(scores), old, ref, rows["loss_mask"], kl_coef))
  for i, (p, c) in enumerate(zip(lengths, clen)):
    want = _reference_token_rewards(_per_token(old, i, p, c), _per_token(ref, i, p, c),
                                    float(scores[i]), kl_coef)
    np.testing.assert_allclose(_per_token(got, i, p, c), want, rtol=1e-5, atol=1e-6,
                               err_msg=f"row {i} (prompt {p}, completion {c})")
    outside = np.ones(got.shape[1], bool)
    outside[p - 1:p - 1 + c] = False
    assert not got[i, outside].any(), f"row {i}: a reward outside its completion"


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.7, 0.0)])
def test_gae_and_returns_match_the_reference_per_completion_token(gamma, lam):
  lengths, tokens, clen, rows, old, ref, values, scores = _made_up_rows(1)
  _check_layout(rows, lengths, tokens, clen)
  mask = rows["loss_mask"]
  rewards = ppo.token_rewards(jnp.asarray(scores), old, ref, mask, 0.2)
  adv, ret = map(np.asarray, ppo.gae(rewards, jnp.asarray(values), mask, gamma, lam))
  for i, (p, c) in enumerate(zip(lengths, clen)):
    r_k = _reference_token_rewards(_per_token(old, i, p, c), _per_token(ref, i, p, c),
                                   float(scores[i]), 0.2)
    want_adv, want_ret = _reference_gae(r_k, _per_token(values, i, p, c), gamma, lam)
    where = f"row {i} (prompt {p}, completion {c}), gamma {gamma}, lambda {lam}"
    np.testing.assert_allclose(_per_token(adv, i, p, c), want_adv, rtol=1e-5, atol=1e-5,
                               err_msg=f"advantages, {where}")
    np.testing.assert_allclose(_per_token(ret, i, p, c), want_ret, rtol=1e-5, atol=1e-5,
                               err_msg=f"returns, {where}")
  assert not adv[mask == 0].any() and not ret[mask == 0].any()


def test_whitening_is_over_the_batchs_completion_tokens_only():
  lengths, _, clen, rows, _, _, values, _ = _made_up_rows(2)
  mask = rows["loss_mask"]
  # Large entries outside the completions: they must not move the mean or the spread.
  adv = np.where(mask > 0, values * 3 + 1, 1e3).astype(np.float32)
  got = np.asarray(ppo.whiten(jnp.asarray(adv), mask))
  want = _reference_whiten([_per_token(adv, i, p, c) for i, (p, c) in enumerate(zip(lengths,
                                                                                     clen))])
  for i, (p, c) in enumerate(zip(lengths, clen)):
    np.testing.assert_allclose(_per_token(got, i, p, c), want[i], rtol=1e-5, atol=1e-5,
                               err_msg=f"row {i}")
  assert not got[mask == 0].any()


# -- the jitted preparation of a batch of rollouts, through the model ------------------------------

KL_COEF, GAMMA, LAM = 0.2, 0.9, 0.8


@pytest.fixture(scope="module")
def ppo_feeder(tmp_path_factory):
  """configs/ppo_tiny.py on a 2-layer model: 8 prompts per batch of rollouts (4 per step,
  2 minibatches, 4 epochs), a KL penalty, γ and λ below 1; the policy's weights moved away from
  the reference's (the initial ones), so the penalty is not 0."""
  from jaxtrain.train import setup as train_setup  # pylint: disable=import-outside-toplevel
  from jaxtrain.data import prompts  # pylint: disable=import-outside-toplevel
  from tests.helpers import mesh_of, shipped_config  # pylint: disable=import-outside-toplevel
  config = shipped_config("ppo_tiny", **{
      "model.num_layers": 2, "train.global_batch_size": 4, "grpo.max_new_tokens": 8,
      "train.seq_len": 28, "ppo.kl_coef": KL_COEF, "ppo.gamma": GAMMA, "ppo.lam": LAM,
      # Rollouts drawn at another temperature than 1: every log-prob is at it (docs/finetuning.md).
      "grpo.temperature": 0.7})
  setup = train_setup.build(config, mesh_of((1, 1, 1)))
  state = train_setup.init_state(setup, seed=0)
  leaves, treedef = jax.tree.flatten(state.params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  moved = [x + 0.5 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) if x.ndim else x
           for x, k in zip(leaves, keys)]
  state = state.replace(params=jax.tree.unflatten(treedef, moved))
  feeder = setup.objective.make_feeder(config, setup, str(tmp_path_factory.mktemp("ppo")))
  return config, setup, state, feeder, iter(prompts.make_train_iterator(config))


def _completion_of_row(i, n, eos):
  """Hand-made completion i of n byte tokens: EOS early with tokens after it, at the end, or
  none."""
  stop = [1, None, 4, n - 1, 0, 6, None, 2][i % 8]
  row = 3 + (i * 37 + np.arange(n) * 11) % 250
  if stop is not None:
    row[stop] = eos
  return row.astype(np.int32)


def _score_of(tokens):
  """A score that depends on the completion's tokens (so a row's score follows its row)."""
  return float(np.sum(tokens) % 17) / 8.0 - 1.0


def _stub_sampling(feeder, monkeypatch, calls=None):
  """The feeder's generation and reward replaced by hand-made completions and a score of their
  tokens; everything after them (training rows, the jitted preparation, minibatches) is the
  feeder's own."""
  n, eos = feeder.sampling.max_new_tokens, feeder.tokenizer.eos_id

  keys = {}  # the same key (the same step): the same completions, as the sampler draws

  def complete(state, prompt_BP, lengths_B, key, sampling, with_logprobs=False, **kwargs):
    del state, lengths_B, sampling, kwargs
    if calls is not None:
      calls.append(key)
    offset = keys.setdefault(tuple(np.asarray(jax.random.key_data(key)).ravel()), 8 * len(keys))
    b = prompt_BP.shape[0]
    tokens = np.stack([_completion_of_row(offset + i, n, eos) for i in range(b)])
    lengths = completion_lengths(tokens, eos)
    if not with_logprobs:
      return tokens, lengths
    return tokens, lengths, np.full(tokens.shape, np.nan, np.float32), None

  def score(records, prompt_BP, lengths_B, tokens_BN, completion_len_B):
    del records, prompt_BP, lengths_B
    r = np.array([_score_of(t[:c]) for t, c in zip(tokens_BN, completion_len_B)])
    return r, {"hand_made": r}, None, None

  monkeypatch.setattr(feeder, "_complete", complete)
  monkeypatch.setattr(feeder, "_score", score)


def _model_per_token(setup, params, prompts, lengths, tokens, clen, vocab_limit, temperature):
  """(log-probs, values) of each completion token from one causal forward pass over each row's
  prompt + completion (right-padded: no position looks ahead): position s's token from the
  logits and the value at s - 1, the softmax of logits / temperature over the tokenizer's ids
  (the distribution the rollouts are drawn from)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  b = len(lengths)
  z = np.zeros((b, int(max(lengths + clen))), np.int32)
  for i in range(b):
    seq = np.concatenate([prompts[i, :lengths[i]], tokens[i, :clen[i]]])
    z[i, :len(seq)] = seq

  @jax.jit
  def forward(params, z):
    model = nnx.merge(setup.graphdef, params)
    logits = model(z)
    return logits, model.values(model.hidden_states(z))
  logits, values = map(lambda x: np.asarray(x, np.float64), forward(params, jnp.asarray(z)))
  logits = logits[..., :vocab_limit] / temperature
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  per_token = []
  for i in range(b):
    p, c = int(lengths[i]), int(clen[i])
    s = np.arange(p, p + c)  # the completion's positions in its sequence
    per_token.append((logp[i, s - 1, z[i, s]], values[i, s - 1]))
  return per_token


@pytest.mark.slow(seconds=10)  # the module's model and its jitted preparation: ~8 s to build
def test_prepared_rollouts_match_the_reference_through_the_model(ppo_feeder, monkeypatch):
  """One batch of rollouts through the feeder (hand-made completions, the jitted preparation
  with the policy and the reference): each completion token's old log-prob and value, its
  advantage and return, and the batch's statistics, against the numpy reference from a plain
  forward pass over each row's tokens."""
  config, setup, state, feeder, it = ppo_feeder
  _stub_sampling(feeder, monkeypatch)
  local = feeder._prompts(lambda: next(it))  # pylint: disable=protected-access
  rows, metrics, _ = feeder._rollout(state, 1, local, 0)  # pylint: disable=protected-access
  prompts, lengths = local["prompt_ids"], local["prompt_lengths"]
  b, n = len(lengths), config.grpo.max_new_tokens
  assert b == 8 and len(set(lengths.tolist())) > 2, lengths  # prompts of different lengths
  eos = feeder.tokenizer.eos_id
  tokens = np.stack([_completion_of_row(i, n, eos) for i in range(b)])
  clen = completion_lengths(tokens, eos)
  assert sorted(set(clen.tolist())) == [1, 2, 3, 5, 7, 8], clen  # EOS early, last, never
  per_token = lambda params: _model_per_token(setup, params, prompts, lengths, tokens, clen,
                                             feeder.tokenizer.vocab_size,
                                             config.grpo.temperature)
  policy, reference = per_token(state.params), per_token(state.frozen.reference)
  mask = rows["loss_mask"] > 0
  want_adv, want_ret, kl_sums = [], [], []
  for i in range(b):
    (old_k, v_k), (ref_k, _) = policy[i], reference[i]
    where = np.flatnonzero(mask[i])  # the rows' positions of this completion's tokens
    assert len(where) == clen[i], (i, where)
    np.testing.assert_array_equal(rows["targets"][i, where], tokens[i, :clen[i]])
    np.testing.assert_allclose(rows["old_logprobs"][i, where], old_k, rtol=1e-4, atol=1e-4,
                               err_msg=f"old log-probs, row {i}")
    np.testing.assert_allclose(rows["old_values"][i, where], v_k, rtol=1e-4, atol=1e-4,
                               err_msg=f"old values, row {i}")
    r_k = _reference_token_rewards(old_k, ref_k, _score_of(tokens[i, :clen[i]]), KL_COEF)
    adv, ret = _reference_gae(r_k, v_k, GAMMA, LAM)
    np.testing.assert_allclose(rows["returns"][i, where], ret, rtol=1e-4, atol=1e-4,
                               err_msg=f"returns, row {i}")
    want_adv.append(adv)
    want_ret.append(ret)
    kl_sums.append(np.sum(old_k - ref_k))
  whitened = _reference_whiten(want_adv)
  for i in range(b):
    np.testing.assert_allclose(rows["advantages"][i, mask[i]], whitened[i], rtol=1e-4,
                               atol=1e-4, err_msg=f"whitened advantages, row {i}")
  for key in ("old_values", "advantages", "returns"):  # nothing outside the completions
    assert not rows[key][~mask].any(), key
  # The batch's statistics, measured before its updates.
  flat_adv, flat_ret = np.concatenate(want_adv), np.concatenate(want_ret)
  flat_v = np.concatenate([v for _, v in policy])
  scores = [_score_of(tokens[i, :clen[i]]) for i in range(b)]
  # The policy has moved from the reference, and the values are not small against the rewards.
  gaps = np.concatenate([old - ref for (old, _), (ref, _) in zip(policy, reference)])
  assert np.abs(gaps).mean() > 0.1 and np.std(flat_v) > 0.1
  np.testing.assert_allclose(metrics["kl"], np.mean(kl_sums), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(metrics["advantage_mean"], flat_adv.mean(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(metrics["explained_variance"],
                             1 - np.var(flat_ret - flat_v) / np.var(flat_ret), rtol=1e-4,
                             atol=1e-4)
  np.testing.assert_allclose(metrics["reward_mean"], np.mean(scores), rtol=1e-6)
  assert metrics["completion_len_mean"] == pytest.approx(clen.mean())


def test_each_epoch_visits_every_row_once_in_minibatches(ppo_feeder, monkeypatch):
  """A batch of rollouts serves ppo.epochs x ppo.minibatches steps: it is drawn at the first of
  them only; each epoch's minibatches split its rows, each row whole and exactly once, in an
  order of its own; the orders depend on the batch's first step, and drawing the same batch
  again gives the same minibatches."""
  config, _, state, feeder, it = ppo_feeder
  calls = []
  _stub_sampling(feeder, monkeypatch, calls)
  monkeypatch.setattr(feeder, "current", None)
  epochs, minibatches = config.ppo.epochs, config.ppo.minibatches
  per_rollout, rows_per_step = epochs * minibatches, config.train.global_batch_size
  next_local = lambda: next(it)

  def serve(first_step):
    """{step: the row indices of the batch of rollouts it trained on}, and those rows."""
    served, whole = {}, None
    for step in range(first_step, first_step + per_rollout):
      batch, _ = feeder.next_batch(state, step, next_local)
      batch = {k: np.asarray(v) for k, v in batch.items()}
      if whole is None:
        whole = feeder.current[0]
      assert len(batch["targets"]) == rows_per_step
      # Each row whole: every key of the batch is the same row of the batch of rollouts.
      idx = [int(np.flatnonzero((whole["targets"] == r).all(axis=1))[0])
             for r in batch["targets"]]
      for key, v in batch.items():
        np.testing.assert_array_equal(v, whole[key][idx], err_msg=f"{key}, step {step}")
      served[step] = idx
      assert feeder.at_boundary(step) == (step == first_step + per_rollout - 1)
    return served, whole

  first, whole = serve(1)
  assert len(calls) == 1  # one batch of rollouts for all its steps
  n = len(whole["targets"])
  assert n == rows_per_step * minibatches
  assert len({tuple(r) for r in whole["targets"]}) == n  # rows tell apart
  orders = []
  for e in range(epochs):
    order = sum((first[1 + e * minibatches + j] for j in range(minibatches)), [])
    assert sorted(order) == list(range(n)), f"epoch {e}: {order}"
    orders.append(tuple(order))
  assert len(set(orders)) == epochs, orders  # each epoch shuffles anew
  second, _ = serve(1 + per_rollout)
  assert len(calls) == 2
  assert [second[s + per_rollout] for s in first] != list(first.values())
  # The same batch of rollouts (the same first step) again: the same minibatches; under another
  # train.seed, others.
  monkeypatch.setattr(feeder, "current", None)
  again, _ = serve(1)
  assert again == first
  monkeypatch.setattr(feeder, "current", None)
  monkeypatch.setattr(feeder, "seed", feeder.seed + 1)
  reseeded, _ = serve(1)
  assert reseeded != first
