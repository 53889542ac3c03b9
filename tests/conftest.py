"""Test setup: 8 emulated CPU devices, configured before JAX initializes a backend."""

import os

# Must run before any JAX backend exists; conftest is imported before the test modules.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
