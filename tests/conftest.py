"""Test setup: 8 emulated CPU devices, configured before JAX initializes a backend."""

import fcntl
import gc
import os
import shutil

import pytest

# Before anything imports jax: jax reads JAX_PLATFORMS when it is imported. With the GPU plugin
# installed (the [aot] extra) and no GPU, a backend search that tries CUDA fails inside the
# plugin, and the deviceless GPU compiles' topology then cannot be made.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jaxtrain import compat  # noqa: E402  (imports jax; reads its version from the metadata)

# Compile time dominates the suite on CPU. XLA's backend optimizations roughly halve it when off
# (tests/test_grpo_training.py: 130 s -> 49 s on 2 cores) and change results only by float
# rounding, which every comparison here tolerates; runs compared bitwise use the same flags.
# XLA:CPU's MLIR fusion emitters cost most of what is left: the classic LLVM IR emitters compile
# the tiny test models' train steps in about a third of the CPU time (building and compiling
# small_config on three meshes: 8.8 s -> 3.4 s of CPU).
# (jax 0.12's XLA has no classic emitters: there the flag is left out, jaxtrain/compat.py.)
FAST_XLA_FLAG = f"--xla_backend_optimization_level=0 {compat.cpu_classic_emitter_flag()}".strip()

# Must run before any JAX backend exists; conftest is imported before the test modules.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA_FLAG}".strip()
import jax  # noqa: E402

# Tracing and lowering allocate millions of short-lived Python objects, and the default
# thresholds (700, 10, 10) run the cyclic collector over them thousands of times per compile:
# collecting less often takes 7% off the compile-bound tests (tests/test_moe_training.py's
# expert-parallel tests: 56 s -> 52 s); reference counting still frees almost everything.
gc.set_threshold(50_000, 20, 100)

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
  """Each test process's runs, in subprocesses or in this process, share JAX's persistent
  compilation cache, so a program they have in common (the tiny config's train step, its eval
  step, the init) is compiled once rather than once per run: a resumed run, a rerun or a second
  fine-tuning stage then starts in seconds.

  The cache also keeps XLA:GPU's compiled kernels (`jax_persistent_cache_enable_xla_caches`):
  the deviceless GPU compiles of configs that share kernels (the 8B configs' fine-tuning
  variants) then skip those kernels' LLVM and ptxas runs (the shipped-config fit tests: 312 ->
  280 s of CPU). One cache per xdist worker: XLA rewrites the kernel file in place, which two
  processes must not do at once (a half-written file fails the other's compile)."""
  cache = tmp_path_factory.getbasetemp() / "jax_compilation_cache"
  cache.mkdir(exist_ok=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  # This process too: in-process CLI runs (helpers.run_cli) and parity tests compile the same
  # small programs as each other and as the subprocesses. The kernel cache only here: the
  # subprocesses (which inherit the directory) leave the kernel file alone.
  jax.config.update("jax_compilation_cache_dir", str(cache))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_enable_xla_caches", "all")
  return cache


@pytest.fixture(scope="session")
def reward_tiny_workdir(tmp_path_factory):
  """configs/reward_tiny.py as shipped (300 steps, its checkpoint at the end), trained once for
  the whole test run: the xdist workers share it through a lock in their common directory. In a
  process of its own without FAST_XLA_FLAG: 300 steps run faster compiled with XLA's
  optimizations (31 s against 73 s in this process on 2 cores) than they lose compiling. At
  backend optimization level 1 rather than the default 2: the same training bit for bit (every
  logged loss, gradient norm, accuracy and reward; only the margin metric differs, in its last
  bit), in about 15% less CPU time (46 s against 53 s, 2026-12-07)."""
  from tests.helpers import run_main  # pylint: disable=import-outside-toplevel
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  workdir = root / "reward_tiny"
  with open(root / "reward_tiny.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (workdir / "trained").exists():
      shutil.rmtree(workdir, ignore_errors=True)
      proc = run_main("--config=configs/reward_tiny.py", f"--workdir={workdir}",
                      env={"XLA_FLAGS": "--xla_backend_optimization_level=1"})
      assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
      (workdir / "trained").write_text("", encoding="utf-8")
  return workdir


def _start_order(item):
  slow = item.get_closest_marker("slow")
  return (slow is None, -(slow.kwargs.get("seconds", 0) if slow else 0))


def pytest_collection_modifyitems(items):
  """The longest tests (marked slow) start first, the longest of those (`slow(seconds=N)`, an
  estimate on 2 cores) before the rest, so that no minute-long test is left to run alone on one
  worker at the end (worksteal takes queued tests from the back); otherwise collection order."""
  items.sort(key=_start_order)
