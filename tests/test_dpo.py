"""DPO: sequence log-probs against full-logit references, the sigmoid loss and its metrics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import create_model, init_params
from jaxtrain.objectives.dpo.loss import dpo_loss, sequence_logprobs
from jaxtrain.objectives.forward import Frozen
from jaxtrain.train.step import make_grad_fn
from tests.helpers import mesh_of

CFG = ModelConfig.of(vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_position_embeddings=64, remat_policy="none")


@functools.lru_cache(maxsize=None)
def _model(seed):
  return create_model(CFG, mesh_of((1, 1, 1)), seed=seed)


def _side(rng, b, t, prompt_len):
  """Right-padded rows: a shared-length prompt, a response of random length, then padding."""
  ids = rng.integers(1, CFG.arch.vocab_size, (b, t)).astype(np.int32)
  attention = np.zeros((b, t), np.int32)
  loss = np.zeros((b, t), np.float32)
  for i in range(b):
    n = int(rng.integers(prompt_len + 2, t + 1))
    attention[i, :n] = 1
    loss[i, prompt_len:n] = 1
    ids[i, n:] = 0
  return ids, attention, loss


def _batch(seed=0, b=3, t=16, prompt_len=5):
  rng = np.random.default_rng(seed)
  out = {}
  for side in ("chosen", "rejected"):
    ids, attention, loss = _side(rng, b, t, prompt_len)
    out |= {f"{side}_input_ids": ids, f"{side}_attention_mask": attention,
            f"{side}_loss_mask": loss}
  return {k: jnp.asarray(v) for k, v in out.items()}


@nnx.jit
def _naive_logprobs(model, ids, attention, loss):
  logits = model(ids, None, attention)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  token_logp = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(token_logp * loss[:, 1:] * attention[:, 1:], axis=-1)


def test_sequence_logprobs_match_full_logits_with_small_chunks():
  model, batch = _model(0), _batch()
  args = [batch[f"chosen_{k}"] for k in ("input_ids", "attention_mask", "loss_mask")]
  got = nnx.jit(sequence_logprobs, static_argnames="chunk_size")(model, *args, chunk_size=4)
  want = _naive_logprobs(model, *args)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_padding_does_not_change_a_sequence_logprob():
  model = _model(1)
  ids, attention, loss = (jnp.asarray(x) for x in _side(np.random.default_rng(3), 1, 10, 4))
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 6)))
  logprobs = nnx.jit(sequence_logprobs)
  short = logprobs(model, ids, attention, loss)
  long = logprobs(model, pad(ids), pad(attention), pad(loss))
  np.testing.assert_allclose(short, long, rtol=1e-6)


def test_loss_and_metrics_match_the_formula():
  policy, reference, batch, beta = _model(0), _model(1), _batch(seed=4), 0.3
  loss, metrics = nnx.jit(dpo_loss, static_argnames=("beta", "chunk_size"))(
      policy, reference, batch, beta, chunk_size=8)
  logps = {(m, side): _naive_logprobs(model, *(batch[f"{side}_{k}"] for k in
                                                ("input_ids", "attention_mask", "loss_mask")))
           for m, model in (("pi", policy), ("ref", reference)) for side in ("chosen", "rejected")}
  chosen = beta * (logps["pi", "chosen"] - logps["ref", "chosen"])
  rejected = beta * (logps["pi", "rejected"] - logps["ref", "rejected"])
  want = np.mean(-np.log(1 / (1 + np.exp(-(chosen - rejected)))))
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(metrics["chosen_rewards"], np.mean(chosen), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["rejected_rewards"], np.mean(rejected), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics["reward_margin"], np.mean(chosen - rejected), rtol=1e-4,
                             atol=1e-6)
  assert float(metrics["reward_accuracy"]) == pytest.approx(np.mean(chosen > rejected))


def test_identical_policy_and_reference_give_log_2_and_only_the_policy_gets_gradients():
  policy, batch = _model(0), _batch(seed=5)
  reference = nnx.clone(policy)  # equal weights, separate variables
  loss, metrics = nnx.jit(dpo_loss, static_argnames="beta")(policy, reference, batch, beta=0.1)
  np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)
  assert float(metrics["reward_margin"]) == 0.0 and float(metrics["reward_accuracy"]) == 0.0

  def loss_of(policy, reference):
    return dpo_loss(policy, reference, batch, beta=0.1)[0]
  grads_policy, grads_reference = nnx.jit(nnx.grad(loss_of, argnums=(0, 1)))(policy, reference)
  policy_norm = sum(float(np.sum(np.square(g))) for g in jax.device_get(
      jax.tree.leaves(grads_policy)))
  reference_norm = sum(float(np.sum(np.square(g))) for g in jax.device_get(
      jax.tree.leaves(grads_reference)))
  assert policy_norm > 0 and reference_norm == 0


def test_a_missing_key_is_named():
  batch = _batch()
  del batch["rejected_loss_mask"]
  with pytest.raises(KeyError, match="rejected_loss_mask"):
    dpo_loss(None, None, batch, beta=0.1)  # checked before either model runs


def test_grad_accumulation_equals_full_batch():
  # The frozen reference enters the accumulation scan; its log-probs and the policy's gradients
  # must come out as for the whole batch at once.
  mesh = mesh_of((1, 1, 1))
  graphdef, params = init_params(CFG, mesh, seed=0)
  _, reference = init_params(CFG, mesh, seed=1)
  batch = _batch(seed=3, b=4)

  def run(steps):
    grad_fn = jax.jit(make_grad_fn(graphdef, grad_accum_steps=steps, loss_chunk_size=8,
                                   objective="dpo", dpo_beta=0.1))
    with jax.set_mesh(mesh):
      loss, count, grads = grad_fn(params, batch, Frozen(reference=reference))
    return float(loss), float(count), jax.tree.leaves(nnx.to_pure_dict(grads))

  full, accumulated = run(1), run(2)
  assert accumulated[1] == full[1] == 4
  np.testing.assert_allclose(accumulated[0], full[0], rtol=1e-5)
  for a, f in zip(accumulated[2], full[2]):
    np.testing.assert_allclose(a, f, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_sequence_logprobs_under_context_parallelism_equal_one_device(strategy):
  """Inputs and their shifted targets go through the context layout together: the per-row
  log-probs of a context=4 x fsdp=2 model equal the one-device model's."""
  mesh = mesh_of({"context": 4, "fsdp": 2})
  model = create_model(CFG.replace(context_parallel=strategy), mesh, seed=0)
  batch = _batch(seed=3, b=4, t=16)
  args = [batch[f"chosen_{k}"] for k in ("input_ids", "attention_mask", "loss_mask")]
  want = _naive_logprobs(_model(0), *args)
  with jax.set_mesh(mesh):
    got = nnx.jit(sequence_logprobs, static_argnames="chunk_size")(model, *args, chunk_size=8)
  np.testing.assert_allclose(got, want, rtol=1e-5)
