"""KV-cache generation: the cached forward equals the training forward, token by token."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.checkpointing.weights import save_params
from jaxtrain.config import load_config_file
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.generate import sampler as generate_lib
from jaxtrain.generate.sampler import SamplingConfig, generate, sample_token
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import create_model
from jaxtrain.train import setup as train_setup
from tests.helpers import REPO, mesh_of, run_generate


@functools.lru_cache(maxsize=None)
def _model(scan_layers=True):
  cfg = ModelConfig.of(vocab_size=53, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                    head_dim=8, mlp_dim=64, max_position_embeddings=64, remat_policy="none",
                    scan_layers=scan_layers, init_std=0.3)  # large weights: varied argmaxes
  return create_model(cfg, mesh_of((1, 1, 1)), seed=0)


def _greedy_without_cache(model, prompt, n):
  # One fixed length (padding after the last token, which causal attention never reads), so
  # the whole-sequence forward compiles once rather than once per length.
  forward = nnx.jit(lambda model, ids: model(ids))
  ids = list(prompt)
  for _ in range(n):
    padded = np.zeros((1, 16), np.int32)  # every prompt here plus its 10 new tokens fits
    padded[0, :len(ids)] = ids
    logits = forward(model, jnp.asarray(padded))
    ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
  return np.array(ids[len(prompt):])


@pytest.mark.parametrize("scan_layers", [True, False])
def test_cached_greedy_equals_recomputing_the_whole_sequence(scan_layers):
  model = _model(scan_layers)
  prompts = [np.array([1, 5, 9, 2, 7]), np.array([3]), np.array([4, 4, 8])]
  got = generate(model, prompts, SamplingConfig(max_new_tokens=10))
  for prompt, row in zip(prompts, got):
    want = _greedy_without_cache(model, prompt, 10)
    np.testing.assert_array_equal(row, want)
  assert len({tuple(r) for r in got}) > 1  # rows of different prompts differ


def test_rows_stop_at_eos_and_sampling_is_seeded():
  model = _model()
  prompt = [np.array([1, 2, 3])]
  first = generate(model, prompt, SamplingConfig(max_new_tokens=12), seed=0)[0]
  eos = int(first[3])
  stopped = generate(model, prompt, SamplingConfig(max_new_tokens=12, eos_id=eos))[0]
  assert stopped[-1] == eos and len(stopped) <= 4
  hot = SamplingConfig(max_new_tokens=12, temperature=1.5, top_p=0.9)
  a, b = (generate(model, prompt * 2, hot, seed=7) for _ in range(2))
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  # The draws follow the seed and the temperature: the rows of one batch (the same prompt) are
  # drawn apart, another seed draws other tokens, and greedy decoding (which ignores the seed)
  # is not what sampling gives.
  assert not np.array_equal(a[0], a[1])
  c = generate(model, prompt * 2, hot, seed=8)
  assert not np.array_equal(a[0], c[0]) and not np.array_equal(a[1], c[1])
  greedy = generate(model, prompt, SamplingConfig(max_new_tokens=12), seed=7)[0]
  np.testing.assert_array_equal(greedy, first)
  assert not np.array_equal(a[0], first) and not np.array_equal(a[1], first)


def test_top_p_keeps_the_smallest_set_reaching_p():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  draws = jax.vmap(lambda k: sample_token(logits, k, 1.0, 0.75))(
      jax.random.split(jax.random.key(0), 2000))
  assert set(np.unique(np.asarray(draws))) == {0, 1}  # 0.5 + 0.3 reaches 0.75
  assert int(sample_token(logits, jax.random.key(1), 0.0, 1.0)[0]) == 0  # greedy


def test_bad_sampling_settings_are_refused():
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(temperature=-1.0)
  with pytest.raises(ValueError, match="at least one token"):
    generate(_model(), [np.array([], np.int32)], SamplingConfig())


def test_cli_continues_prompts_from_a_weights_directory(tmp_path):
  """`python -m jaxtrain.generate` (in this process: tests.helpers.run_generate) on a weights
  directory and a config file prints each prompt's greedy continuation, the one `generate`
  computes from the same weights; a missing directory is one line and exit code 2."""
  config = load_config_file(os.path.join(REPO, "configs", "tiny.py"))
  config.mesh.data = config.mesh.fsdp = config.mesh.tensor = 1
  setup = train_setup.build(config, mesh_of((1, 1, 1)))
  state = train_setup.init_state(setup, seed=0)
  save_params(tmp_path, state.params)
  prompts = ["def f(", "import"]
  ok = run_generate(f"--checkpoint={tmp_path}", "--config=configs/tiny.py",
                    *(f"--prompt={p}" for p in prompts), "--max_new_tokens=8")
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert "--- prompt: 'def f('" in ok.stdout and "--- prompt: 'import'" in ok.stdout
  # What it printed is the greedy continuation of the saved weights.
  tokenizer = load_tokenizer(config.data.tokenizer)
  model = nnx.merge(setup.graphdef, state.params)
  ids = [tokenizer.encode_document(p, add_bos=tokenizer.bos_id is not None, add_eos=False)
         for p in prompts]
  rows = generate(model, ids, SamplingConfig(max_new_tokens=8, eos_id=tokenizer.eos_id,
                                                vocab_size=tokenizer.vocab_size))
  want = "".join(f"--- prompt: {p!r}\n{p}"
                 + tokenizer.decode([int(i) for i in row if i != tokenizer.eos_id]) + "\n"
                 for p, row in zip(prompts, rows))
  assert ok.stdout == want, (ok.stdout, want)
  bad = run_generate(f"--checkpoint={tmp_path / 'missing'}", "--prompt=x")
  assert bad.returncode == 2 and "no such directory" in bad.stderr
  assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def _model_favouring(padded_ids):
  """The small model with its head rewritten so that one of `padded_ids` (two ids) always has
  the largest logit: +c·v and -c·v on their columns, 0 on every other, so for any hidden state
  h one of the two gets c·|h·v| > 0."""
  cfg = ModelConfig.of(vocab_size=53, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_position_embeddings=64, remat_policy="none",
                       init_std=0.3)
  model = create_model(cfg, mesh_of((1, 1, 1)), seed=0)
  v = np.random.default_rng(0).normal(size=32).astype(np.float32)
  head = np.zeros((32, 53), np.float32)
  head[:, padded_ids[0]], head[:, padded_ids[1]] = 50 * v, -50 * v
  model.head_DV[...] = jnp.asarray(head)
  return model


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn():
  """A tokenizer of 51 ids under a model of 53 (padded): a model whose logits favour the padded
  ids 51 and 52 draws them without the limit and never with it, greedy or sampled."""
  model = _model_favouring((51, 52))
  prompts = [np.array([1, 5, 9, 2, 7]), np.array([3]), np.array([4, 4, 8])] * 4
  unlimited = np.concatenate(generate(model, prompts, SamplingConfig(max_new_tokens=10)))
  assert (unlimited >= 51).all()  # the model's favourites
  for sampling in (SamplingConfig(max_new_tokens=10, vocab_size=51),
                   SamplingConfig(max_new_tokens=10, temperature=1.0, vocab_size=51),
                   SamplingConfig(max_new_tokens=10, temperature=2.0, top_p=0.9, vocab_size=51)):
    drawn = np.concatenate(generate(model, prompts, sampling, seed=3))
    assert drawn.max() < 51, sampling
    assert len(np.unique(drawn)) > 1 or sampling.temperature == 0.0
  # sample_token alone: the largest logit on the last id, which the limit rules out.
  logits = jnp.tile(jnp.arange(8, dtype=jnp.float32), (4, 1))
  assert set(np.asarray(sample_token(logits, jax.random.key(0), 0.0, 1.0)).tolist()) == {7}
  draws = jax.vmap(lambda k: sample_token(logits, k, 1.0, 1.0, vocab_size=6))(
      jax.random.split(jax.random.key(0), 500))
  assert np.asarray(draws).max() == 5  # 6 and 7 never; 5 the most likely of the rest
  with pytest.raises(ValueError, match="vocab_size"):
    SamplingConfig(vocab_size=0)


def test_sampler_logprobs_are_the_models_log_softmax_of_the_drawn_tokens():
  """with_logprobs: each drawn token's log-prob under the tempered distribution it was drawn
  from, the softmax of logits / temperature over the ids `vocab_size` allows (before the top-p
  cut), as the whole-sequence forward computes it; 0 after EOS."""
  model = _model()
  prompt_BP = jnp.asarray([[1, 5, 9, 2, 7], [3, 0, 0, 0, 0]], jnp.int32)
  lengths_B = jnp.asarray([5, 1], jnp.int32)
  sampling = SamplingConfig(max_new_tokens=8, temperature=1.5, top_p=0.9, vocab_size=50)
  run = nnx.jit(lambda m, p, l, k: generate_lib.sample_continuations(
      m, p, l, k, sampling, with_logprobs=True))
  tokens_BN, logprobs_BN = (np.asarray(x) for x in run(model, prompt_BP, lengths_B,
                                                       jax.random.key(0)))
  assert tokens_BN.max() < 50
  for b in range(2):
    ids = np.concatenate([np.asarray(prompt_BP[b, :int(lengths_B[b])]), tokens_BN[b]])
    logits = model(jnp.asarray(ids)[None])[0].astype(jnp.float32)
    want = jax.nn.log_softmax(logits[:, :50] / sampling.temperature,
                              axis=-1)[np.arange(len(ids) - 1), ids[1:]]
    p = int(lengths_B[b])
    np.testing.assert_allclose(logprobs_BN[b], np.asarray(want)[p - 1:], rtol=1e-5, atol=1e-5)
  # After EOS a row's log-probs are 0 (the same draws: the same key).
  eos = int(tokens_BN[0, 2])
  k = int(np.argmax(tokens_BN[0] == eos))  # the row's first EOS (at 2 or before)
  stopped = SamplingConfig(max_new_tokens=8, temperature=1.5, top_p=0.9, vocab_size=50,
                           eos_id=eos)
  _, after = nnx.jit(lambda m, p, l, k: generate_lib.sample_continuations(
      m, p, l, k, stopped, with_logprobs=True))(model, prompt_BP, lengths_B, jax.random.key(0))
  after = np.asarray(after)
  assert (after[0, k + 1:] == 0.0).all() and (after[0, :k + 1] < 0).all()
  np.testing.assert_array_equal(after[0, :k + 1], logprobs_BN[0, :k + 1])
