"""Small shared builders for tests: configs, meshes, synthetic packed batches, and the one
harness the tests start `python -m jaxtrain.main` runs with."""

import json
import os
import subprocess
import sys

import jax
import numpy as np

from jaxtrain.config import default_config
from jaxtrain.mesh import make_mesh
from tests.conftest import FAST_XLA_FLAG

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(**model_overrides):
  """A config whose dims divide every test mesh: H=8, K=4, D=64, F=128, V=128."""
  c = default_config()
  m = c.model
  m.vocab_size, m.num_layers, m.d_model = 128, 2, 64
  m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 8, 4, 8, 128
  m.max_position_embeddings = 256
  m.remat_policy = "none"
  for k, v in model_overrides.items():
    setattr(m, k, v)
  c.train.seq_len = 32
  c.train.global_batch_size = 8
  c.train.loss_chunk_size = 16
  c.train.steps = 10
  c.optim.warmup_steps = 2
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  return c


def mesh_of(shape):
  """A mesh over the first prod(sizes) devices; `shape` is a {axis: size} mapping, or a
  (data, fsdp, tensor) tuple (the other axes 1)."""
  if not isinstance(shape, dict):
    shape = dict(zip(("data", "fsdp", "tensor"), shape))
  n = int(np.prod(list(shape.values())))
  return make_mesh(shape, jax.devices()[:n])


def packed_batch(batch_size, seq_len, vocab, seed=0, docs_per_row=2):
  """A batch in the trainer's format: rows of `docs_per_row` packed documents, a padded tail."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch_size, seq_len + 1)).astype(np.int32)
  segment_ids = np.zeros((batch_size, seq_len), np.int32)
  positions = np.zeros((batch_size, seq_len), np.int32)
  for b in range(batch_size):
    used = seq_len - int(rng.integers(0, seq_len // 4))  # the rest is padding
    cuts = np.sort(rng.choice(np.arange(1, used), docs_per_row - 1, replace=False))
    bounds = [0, *cuts.tolist(), used]
    for i in range(docs_per_row):
      lo, hi = bounds[i], bounds[i + 1]
      segment_ids[b, lo:hi] = i + 1
      positions[b, lo:hi] = np.arange(hi - lo)
  return {
      "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
      "loss_mask": (segment_ids > 0).astype(np.float32),
      "segment_ids": segment_ids, "positions": positions,
  }


def main_command(*args):
  """The argv of `python -m jaxtrain.main ARGS`, with this interpreter."""
  return [sys.executable, "-m", "jaxtrain.main", *args]


def main_env(devices: int | None = None, env: dict | None = None) -> dict:
  """The environment of a CLI run: this process's (so the session's compilation cache in
  conftest.py carries over), on CPU, with the suite's fast XLA flag, `devices` emulated CPU
  devices when given, and `env` on top."""
  run_env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA_FLAG)
  if devices is not None:
    run_env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
  run_env.update(env or {})
  return run_env


def run_main(*args, devices: int | None = None, env: dict | None = None, timeout: int = 600,
             cwd=REPO) -> subprocess.CompletedProcess:
  """Runs `python -m jaxtrain.main ARGS` to the end from the repository root (see main_env) and
  returns it, stdout and stderr captured as text; a failing exit code is the caller's to check."""
  return subprocess.run(main_command(*args), cwd=cwd, env=main_env(devices, env),
                        capture_output=True, text=True, timeout=timeout, check=False)


def train_losses(config, shape, steps: int = 3, docs_per_row: int = 3) -> list[float]:
  """Float losses of `steps` train steps of `config` on the mesh `shape` (see mesh_of), in this
  process, on packed synthetic batches (a different one each step, the same on every mesh)."""
  from jaxtrain import train_setup, trainer  # pylint: disable=import-outside-toplevel
  setup = train_setup.build(config, mesh_of(shape))
  state = train_setup.init_state(setup, seed=0)
  losses = []
  with jax.set_mesh(setup.mesh):
    for step in range(steps):
      batch = packed_batch(config.train.global_batch_size, config.train.seq_len,
                           config.model.vocab_size, seed=step, docs_per_row=docs_per_row)
      state, metrics = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
      losses.append(float(metrics["loss"]))
  return losses


def cli_losses(workdir, *args, devices: int | None = None):
  """(stdout, logged train losses) of a `python -m jaxtrain.main ARGS --workdir=WORKDIR` run
  that must succeed."""
  proc = run_main(*args, f"--workdir={workdir}", devices=devices)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return proc.stdout, [r["loss"] for r in map(json.loads, f) if "loss" in r]


def assert_one_line_config_error(config, num_devices: int, words, **validate_kwargs) -> str:
  """Validating `config` for `num_devices` raises a one-line ConfigError containing every one of
  `words`; returns the message."""
  import pytest  # pylint: disable=import-outside-toplevel
  from jaxtrain.config import ConfigError  # pylint: disable=import-outside-toplevel
  from jaxtrain.config_checks import validate  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError) as err:
    validate(config, num_devices, **validate_kwargs)
  message = str(err.value)
  assert "\n" not in message
  for word in words:
    assert word in message, (word, message)
  return message
