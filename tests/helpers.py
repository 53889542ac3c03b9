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
from jaxtrain.parallel.mesh import make_mesh
from tests.conftest import FAST_XLA_FLAG

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shipped_config(name: str, **changes):
  """configs/NAME.py with changes given as {"group.key": value} (e.g. **{"lora.rank": 4})."""
  from jaxtrain.config import load_config_file  # pylint: disable=import-outside-toplevel
  config = load_config_file(os.path.join(REPO, "configs", f"{name}.py"))
  for key, value in changes.items():
    group, name_ = key.split(".")
    config[group][name_] = value
  return config


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
  """The first `n` of this process's CPU devices are all JAX shows (None: all of them), as a
  process started with `n` emulated devices would see: jaxtrain asks `jax.devices()` and
  friends for the mesh, the config checks and the run table. Asking for another backend's
  devices (`jax.local_devices(backend="gpu")`, as Pallas' Triton lowering does for the compute
  capability of a deviceless GPU compile) fails as it does in a CPU-only process."""
  if n is None:
    yield
    return
  import jax  # pylint: disable=import-outside-toplevel
  real_devices, real_local_devices = jax.devices, jax.local_devices
  shown = jax.devices()[:n]
  assert len(shown) == n, f"the test process has {len(jax.devices())} devices, not {n}"

  def devices(backend=None):
    return list(shown) if backend in (None, "cpu") else real_devices(backend)

  def local_devices(process_index=None, backend=None, host_id=None):
    if backend in (None, "cpu"):
      return list(shown)
    return real_local_devices(process_index, backend, host_id)

  def count(backend=None):
    return n if backend in (None, "cpu") else len(real_devices(backend))

  with mock.patch.object(jax, "devices", devices), \
       mock.patch.object(jax, "local_devices", local_devices), \
       mock.patch.object(jax, "device_count", count), \
       mock.patch.object(jax, "local_device_count", count):
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
  # ml_collections loads every config file as the module "config_config" and runs a new file's
  # source inside the module it finds there: a file without get_config() would use the last one.
  sys.modules.pop("config_config", None)
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


# XLA's backend optimizations, which the suite turns off (FAST_XLA_FLAG: compile time dominates
# most tests), pay for themselves in a run of many steps: moe_tiny's step on 8 emulated devices
# compiles in 7.1 s of CPU instead of 4.7 but runs in 0.26 s instead of 0.67 (2 cores,
# 2026-12-08); tiny.py's 0.10 s instead of 0.36. Break-even is near 6 steps.
MANY_STEPS = 10
_OPTIMIZED = {"xla_backend_optimization_level": 1}


def step_for(setup, steps: int, state, global_batch):
  """`setup.train_step`, compiled with XLA's optimizations for a run of at least MANY_STEPS
  steps (from the first step's state and batch, which it then takes again: the same program);
  as is otherwise. Runs compared with each other use the same: the results differ from the
  unoptimized step's by float rounding only."""
  if steps < MANY_STEPS:
    return setup.train_step
  return setup.train_step.lower(state, global_batch).compile(_OPTIMIZED)


def train_curves(config, shape, steps: int = 3, docs_per_row: int = 3) -> dict[str, list[float]]:
  """{"loss": [...], "grad_norm": [...]} of `steps` train steps of `config` on the mesh `shape`
  (see mesh_of), in this process, on packed synthetic batches (a different one each step, the
  same on every mesh). Parity tests compare both: under Adam a gradient scaled by a constant
  (a doubled or missing reduction over a mesh axis) barely moves the losses, never the norm."""
  from jaxtrain.train import loop as trainer  # pylint: disable=import-outside-toplevel
  from jaxtrain.train import setup as train_setup  # pylint: disable=import-outside-toplevel
  setup = train_setup.build(config, mesh_of(shape))
  state = train_setup.init_state(setup, seed=0)
  curves = {"loss": [], "grad_norm": []}
  with jax.set_mesh(setup.mesh):
    train_step = None
    for step in range(steps):
      batch = packed_batch(config.train.global_batch_size, config.train.seq_len,
                           config.model.vocab_size, seed=step, docs_per_row=docs_per_row)
      batch = trainer.to_global_batch(batch, setup.mesh)
      train_step = train_step or step_for(setup, steps, state, batch)
      state, metrics = train_step(state, batch)
      for key, values in curves.items():
        values.append(float(metrics[key]))
  return curves


def logged_curves(workdir, keys=("loss", "grad_norm")) -> dict[str, list[float]]:
  """{key: values at every logged train step} from WORKDIR/metrics.jsonl."""
  rows = [r for r in metrics_records(workdir) if "loss" in r]
  return {key: [r[key] for r in rows] for key in keys}


def cli_curves(workdir, *args, devices: int | None = None) -> tuple[str, dict[str, list[float]]]:
  """(stdout, logged_curves) of a `python -m jaxtrain.main ARGS --workdir=WORKDIR` run in this
  process (run_cli) that must succeed."""
  proc = run_cli(*args, f"--workdir={workdir}", devices=devices)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout, logged_curves(workdir)


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
  from jaxtrain.validation.checks import validate  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError) as err:
    validate(config, num_devices, **validate_kwargs)
  message = str(err.value)
  assert "\n" not in message
  for word in words:
    assert word in message, (word, message)
  return message


def run_entry(main, *args, devices: int | None = None, cwd=REPO) -> CliResult:
  """Runs a command-line entry point `main(argv)` (argv without the program name, as
  `jaxtrain.interop.hf.main` and `jaxtrain.data.prepare.main` take it) in this process, as
  `python -m MODULE ARGS` would: its return value or SystemExit code is the exit code (None: 0),
  an uncaught exception exit code 1 with the traceback in stderr; stdout and stderr captured.
  `devices`: how many of this process's CPU devices it sees (default 1, see run_cli)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
       visible_devices(1 if devices is None else devices):
    try:
      code = main([str(a) for a in args])
    except SystemExit as e:
      code = e.code
    except Exception:  # pylint: disable=broad-except  # as an uncaught error ends a process
      traceback.print_exc()
      code = 1
  code = 0 if code is None else code if isinstance(code, int) else 1
  return CliResult(code, out.getvalue(), err.getvalue())


_ABSL_CLI_FLAGS: dict = {}  # module name -> the absl FlagValues state that holds its flags


@contextlib.contextmanager
def absl_cli_module(name: str):
  """Imports (once) and yields the absl CLI module `name`, its flags defined in absl's FLAGS
  only while inside: each jaxtrain CLI defines its flags in the one global FLAGS, and two of
  them cannot share a process (jaxtrain.generate.cli and jaxtrain.main both define --config).
  Outside, FLAGS is as it was (jaxtrain.main's flags for run_cli); inside, it holds absl's own
  flags and the module's, parsed afresh by each run. Import such a module only through this."""
  import copy  # pylint: disable=import-outside-toplevel
  import importlib  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  state = flags.FLAGS.__dict__
  outside = dict(state)
  inside = _ABSL_CLI_FLAGS.get(name)
  if inside is None:
    assert name not in sys.modules, f"{name} was imported outside absl_cli_module"
    # absl's own flags (logging, app) only, in containers of their own.
    inside = {k: ({m: list(v) for m, v in value.items()} if k.endswith(
        ("__flags_by_module", "__flags_by_module_id", "__key_flags_by_module"))
                  else copy.copy(value)) for k, value in outside.items()}
    state.update(inside)
    own = {f.name for m, fl in flags.FLAGS.flags_by_module_dict().items()
           if m.startswith("absl.") for f in fl}
    for flag_name in [n for n in flags.FLAGS if n not in own]:
      delattr(flags.FLAGS, flag_name)
    try:
      importlib.import_module(name)
    except BaseException:
      state.update(outside)
      raise
  else:
    state.update(inside)
  try:
    yield sys.modules[name]
  finally:
    _ABSL_CLI_FLAGS[name] = dict(state)
    state.update(outside)


def run_generate(*args, devices: int | None = None, cwd=REPO) -> CliResult:
  """Runs `python -m jaxtrain.generate ARGS` in this process (run_entry; its flags held apart
  by absl_cli_module). absl's verbosity and the root logger's handlers, which absl's app.run
  and the CLI set, are restored afterwards."""
  import logging  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  verbosity, handlers = absl_logging.get_verbosity(), list(logging.root.handlers)
  with absl_cli_module("jaxtrain.generate.cli") as generate_cli:
    flags.FLAGS.unparse_flags()
    try:
      return run_entry(lambda argv: generate_cli.run(["jaxtrain.generate", *argv]), *args,
                       devices=devices, cwd=cwd)
    finally:
      flags.FLAGS.unparse_flags()
      absl_logging.set_verbosity(verbosity)
      logging.root.handlers[:] = handlers


# --- CLI runs of a small variant of configs/tiny.py -------------------------------------------

# A smaller, faster variant of configs/tiny.py (same code path) for CLI runs.
SMALL_TINY_ARGS = ["--config.model.num_layers=2", "--config.model.d_model=64",
                   "--config.model.mlp_dim=128", "--config.model.num_heads=4",
                   "--config.model.num_kv_heads=2", "--config.model.head_dim=16",
                   "--config.train.seq_len=64", "--config.train.global_batch_size=8",
                   "--config.train.eval_batches=2"]


def metrics_records(workdir) -> list[dict]:
  """Every record of WORKDIR/metrics.jsonl, in order."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def run_tiny(workdir, *overrides, devices: int | None = None) -> tuple[CliResult, list[dict]]:
  """(result, metrics_records) of `python -m jaxtrain.main --config=configs/tiny.py
  --workdir=WORKDIR SMALL_TINY_ARGS OVERRIDES` run in this process (run_cli), which must
  succeed."""
  proc = run_cli("--config=configs/tiny.py", f"--workdir={workdir}", *SMALL_TINY_ARGS,
                 *overrides, devices=devices)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc, metrics_records(workdir)


# --- LoRA and DPO training configs and batches (shared by the LoRA and pipeline tests) --------

# small_config's model as each non-Llama family (models/registry.py), with every switch and
# architecture field of the family in play: windows (8 tokens) shorter than the 32-token
# sequences, Gemma 3's two layer types with their own RoPE, its softmax scale and tied head.
FAMILY_OVERRIDES = {
    "qwen3": dict(family="qwen3"),
    "qwen2": dict(family="qwen2"),
    "mistral": dict(family="mistral", sliding_window=8),
    "gemma3": dict(family="gemma3", sliding_window=8, layer_types="sliding,full",
                   local_rope_theta=1e4, query_pre_attn_scalar=24.0, tie_embeddings=True),
}


def family_config(family: str, **model_overrides):
  """small_config as `family` (FAMILY_OVERRIDES); Gemma 3's global layers get linear RoPE
  scaling, as its published models have."""
  c = small_config(**{**FAMILY_OVERRIDES[family], **model_overrides})
  if family == "gemma3":
    c.model.rope_scaling.type, c.model.rope_scaling.factor = "linear", 8.0
  return c


def lora_config(quantize_base="none", objective="lm", family=None):
  """small_config (as `family` when given) with rank-4 adapters on q, v, o, gate and down (quant
  groups of 32), a high learning rate without weight decay, and `objective` ("dpo": preference
  data)."""
  c = family_config(family) if family else small_config()
  c.lora.rank, c.lora.alpha, c.lora.targets = 4, 8.0, "q,v,o,gate,down"
  c.lora.quantize_base, c.lora.quant_group_size = quantize_base, 32
  c.optim.learning_rate, c.optim.weight_decay = 1e-2, 0.0
  c.train.objective = objective
  if objective == "dpo":
    c.data.format = "preference"
  return c


def dpo_pair_batch(seed=0, b=8, t=33):
  """A preference batch in the trainer's format: `b` chosen and `b` rejected rows of `t` tokens
  (vocab 128), right-padded after 12..t tokens, the loss on the tokens from position 8 on."""
  rng = np.random.default_rng(seed)
  out = {}
  for side in ("chosen", "rejected"):
    ids = rng.integers(1, 128, (b, t)).astype(np.int32)
    n = rng.integers(12, t + 1, b)
    attention = (np.arange(t)[None] < n[:, None]).astype(np.int32)
    loss = attention * (np.arange(t)[None] >= 8)
    out |= {f"{side}_input_ids": ids * attention, f"{side}_attention_mask": attention,
            f"{side}_loss_mask": loss.astype(np.float32)}
  return out


# A `python -m jaxtrain.main` process that compiles as this test process does: XLA:CPU with as
# many devices as this process has (conftest.py's 8), of which it shows the first N (argv[1]),
# then jaxtrain.main's flag parsing and main. JAX's compilation cache keys hold the client's
# device topology, so a CLI process with 1 device of 1 (run_main) compiles everything afresh,
# while this one finds what this process (run_cli, train_curves) compiled in the session's
# cache, and the reverse. For a run whose process is the point (a kill) that need not be
# `python -m jaxtrain.main` itself (the platform choice and the huge-page re-exec).
_CLI_PROCESS_CODE = """
import sys
from unittest import mock
import jax
n = int(sys.argv[1])
devices = jax.devices()[:n]
with mock.patch.object(jax, "devices", lambda *_: list(devices)), \\
     mock.patch.object(jax, "local_devices", lambda *_, **__: list(devices)), \\
     mock.patch.object(jax, "device_count", lambda *_: n), \\
     mock.patch.object(jax, "local_device_count", lambda *_: n):
  from absl import app
  from jaxtrain import main as cli
  from jaxtrain.cli_flags import parse_flags
  app.run(cli.main, argv=["jaxtrain.main", *sys.argv[2:]], flags_parser=parse_flags)
"""


def cli_process_command(*args, devices: int = 1) -> list[str]:
  """The argv of a jaxtrain.main process that shares this process's compilations (see
  _CLI_PROCESS_CODE), seeing `devices` devices; run it with cli_process_env()."""
  return [sys.executable, "-c", _CLI_PROCESS_CODE, str(devices), *map(str, args)]


def cli_process_env(env: dict | None = None) -> dict:
  """main_env() (no emulated-device flag: the XLA flags are this process's) with this process's
  CPU device count, and `env` on top."""
  return main_env(env={"JAX_NUM_CPU_DEVICES": str(len(jax.devices())), **(env or {})})


def kill_cli_process_after_step(workdir, step: int, *args, devices: int = 1,
                                timeout: float = 300):
  """Starts `jaxtrain.main ARGS --workdir=WORKDIR` as a process of its own (cli_process_command)
  and SIGKILLs it once WORKDIR/metrics.jsonl shows `step`; fails if it ended before."""
  import signal  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  proc = subprocess.Popen(cli_process_command(*args, f"--workdir={workdir}", devices=devices),
                          cwd=REPO, env=cli_process_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + timeout
  try:
    while time.time() < deadline and proc.poll() is None:
      if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
          steps = [json.loads(l).get("step", 0) for l in f if l.strip().endswith("}")]
        if steps and max(steps) >= step:
          break
      time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def safetensors_tensors(directory) -> dict:
  """Every tensor of the *.safetensors files in `directory`, by name, as numpy arrays."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  out = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(directory, name), framework="numpy") as f:
        out.update({k: f.get_tensor(k) for k in f.keys()})
  return out


def assert_same_safetensors(got_dir, want_dir) -> None:
  """The *.safetensors of both directories hold the same tensors, bit for bit."""
  got, want = safetensors_tensors(got_dir), safetensors_tensors(want_dir)
  assert sorted(got) == sorted(want)
  for name, x in want.items():
    np.testing.assert_array_equal(got[name], x, err_msg=name)
