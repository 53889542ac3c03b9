"""KV-cache generation: the cached forward equals the training forward, token by token."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import train_setup
from jaxtrain.checkpoint import save_params
from jaxtrain.config import load_config_file
from jaxtrain.generate import SamplingConfig, generate, sample_token
from jaxtrain.model import ModelConfig
from jaxtrain.sharding import create_model
from tests.helpers import mesh_of


@functools.lru_cache(maxsize=None)
def _model(scan_layers=True):
  cfg = ModelConfig(vocab_size=53, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
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


@pytest.mark.slow
def test_cli_continues_prompts_from_a_weights_directory(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = load_config_file(os.path.join(repo, "configs", "tiny.py"))
  config.mesh.data = config.mesh.fsdp = config.mesh.tensor = 1
  state = train_setup.init_state(train_setup.build(config, mesh_of((1, 1, 1))), seed=0)
  save_params(tmp_path, state.params)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda *args: subprocess.run(
      [sys.executable, "-m", "jaxtrain.generate", *args], cwd=repo, env=env,
      capture_output=True, text=True, timeout=300)
  ok = run(f"--checkpoint={tmp_path}", "--config=configs/tiny.py", "--prompt=def f(",
           "--prompt=import", "--max_new_tokens=8")
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert "--- prompt: 'def f('" in ok.stdout and "--- prompt: 'import'" in ok.stdout
  bad = run(f"--checkpoint={tmp_path / 'missing'}", "--prompt=x")
  assert bad.returncode == 2 and "no such directory" in bad.stderr
