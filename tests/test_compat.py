"""jaxtrain/compat.py answers for the JAX that is installed (the suite runs on jax 0.10.2 and
0.12: .ci/run's two legs)."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import compat
from tests.helpers import REPO


def test_the_version_is_the_imported_jaxs():
  assert compat.jax_version() == tuple(int(n) for n in re.findall(r"\d+", jax.__version__)[:3])


def test_the_emitter_options_compile_on_this_xla():
  """Both choices compile and compute the same (jax 0.12's XLA would reject the option that
  jax 0.10's takes)."""
  x = jnp.arange(12.0).reshape(3, 4)
  lowered = jax.jit(lambda x: jnp.tanh(x) @ x.T).lower(x)
  got = [np.asarray(lowered.compile(compat.cpu_emitter_options(fusion_emitters=f))(x))
         for f in (True, False)]
  np.testing.assert_allclose(got[0], got[1], rtol=1e-6)
  assert bool(compat.cpu_emitter_options(True)) == compat.has_classic_cpu_emitters()


def test_the_classic_emitter_flag_starts_a_backend():
  """XLA_FLAGS with the flag (or without it, where XLA has no classic emitters) start the CPU
  backend in a fresh process: an unknown flag would abort it."""
  flag = compat.cpu_classic_emitter_flag()
  assert (flag != "") == compat.has_classic_cpu_emitters()
  proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
                        env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flag, "PATH": "/usr/bin"},
                        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0 and proc.stdout.strip() == "cpu", proc.stderr[-2000:]
