"""Small shared builders for tests: configs, meshes, synthetic packed batches, and the one
harness the tests start `python -m jaxtrain.main` runs with."""

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import traceback
from unittest import mock

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


@dataclasses.dataclass
class CliResult:
  """What a CLI run left: its exit code and what it printed (the fields of CompletedProcess
  that the tests read)."""
  returncode: int
  stdout: str
  stderr: str


@contextlib.contextmanager
def visible_devices(n: int | None):
  """The first `n` of this process's devices are all JAX shows (None: all of them), as a
  process started with `n` emulated devices would see: jaxtrain asks `jax.devices()` and
  friends for the mesh, the config checks and the run table."""
  if n is None:
    yield
    return
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.devices()[:n]
  assert len(devices) == n, f"the test process has {len(jax.devices())} devices, not {n}"
  with mock.patch.object(jax, "devices", lambda *_: list(devices)), \
       mock.patch.object(jax, "local_devices", lambda *_, **__: list(devices)), \
       mock.patch.object(jax, "device_count", lambda *_: n), \
       mock.patch.object(jax, "local_device_count", lambda *_: n):
    yield


def run_cli(*args, devices: int | None = None, cwd=REPO) -> CliResult:
  """Runs `python -m jaxtrain.main ARGS` in this process: the same flag parsing, `main` and
  exit codes, without a new interpreter's imports and compiles (programs it shares with other
  tests come from the session's compilation cache). `devices`: how many of this process's 8
  CPU devices the run sees (default 1, like a CLI process without emulated devices).

  For what does not need a process of its own; signals, several processes and the re-exec
  with huge pages need `run_main`."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from jaxtrain import main as cli  # pylint: disable=import-outside-toplevel
  from jaxtrain.cli_flags import parse_flags  # pylint: disable=import-outside-toplevel
  argv = ["jaxtrain.main", *map(str, args)]
  out, err = io.StringIO(), io.StringIO()
  code = 0
  flags.FLAGS.unparse_flags()
  with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
       visible_devices(1 if devices is None else devices), \
       mock.patch.object(sys, "argv", argv):  # ml_collections reads overrides from sys.argv
    try:
      cli.main(parse_flags(argv))
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:  # pylint: disable=broad-except  # as an uncaught error ends a process
      traceback.print_exc()
      code = 1
    finally:
      flags.FLAGS.unparse_flags()
      for name in [n for n in flags.FLAGS if n.startswith("config.")]:
        delattr(flags.FLAGS, name)  # ml_collections defines one flag per override per parse
  return CliResult(code, out.getvalue(), err.getvalue())


def train_curves(config, shape, steps: int = 3, docs_per_row: int = 3) -> dict[str, list[float]]:
  """{"loss": [...], "grad_norm": [...]} of `steps` train steps of `config` on the mesh `shape`
  (see mesh_of), in this process, on packed synthetic batches (a different one each step, the
  same on every mesh). Parity tests compare both: under Adam a gradient scaled by a constant
  (a doubled or missing reduction over a mesh axis) barely moves the losses, never the norm."""
  from jaxtrain import train_setup, trainer  # pylint: disable=import-outside-toplevel
  setup = train_setup.build(config, mesh_of(shape))
  state = train_setup.init_state(setup, seed=0)
  curves = {"loss": [], "grad_norm": []}
  with jax.set_mesh(setup.mesh):
    for step in range(steps):
      batch = packed_batch(config.train.global_batch_size, config.train.seq_len,
                           config.model.vocab_size, seed=step, docs_per_row=docs_per_row)
      state, metrics = setup.train_step(state, trainer.to_global_batch(batch, setup.mesh))
      for key, values in curves.items():
        values.append(float(metrics[key]))
  return curves


def train_losses(config, shape, steps: int = 3, docs_per_row: int = 3) -> list[float]:
  """The losses of `train_curves`."""
  return train_curves(config, shape, steps, docs_per_row)["loss"]


def logged_curves(workdir, keys=("loss", "grad_norm")) -> dict[str, list[float]]:
  """{key: values at every logged train step} from WORKDIR/metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [r for r in map(json.loads, f) if "loss" in r]
  return {key: [r[key] for r in rows] for key in keys}


def cli_curves(workdir, *args, devices: int | None = None) -> tuple[str, dict[str, list[float]]]:
  """(stdout, logged_curves) of a `python -m jaxtrain.main ARGS --workdir=WORKDIR` run in this
  process (run_cli) that must succeed."""
  proc = run_cli(*args, f"--workdir={workdir}", devices=devices)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout, logged_curves(workdir)


def cli_losses(workdir, *args, devices: int | None = None):
  """(stdout, logged train losses) of `cli_curves`."""
  out, curves = cli_curves(workdir, *args, devices=devices)
  return out, curves["loss"]


def assert_curves_close(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 0.0):
  """Every curve of `expected` (loss, grad_norm, ...) equals `actual`'s within rtol/atol, at
  every step."""
  for key, want in expected.items():
    np.testing.assert_allclose(actual[key], want, rtol=rtol, atol=atol, err_msg=key)


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
