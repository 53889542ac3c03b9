"""Which JAX backends a command starts, chosen before JAX is imported.

With the `aot` extra installed, the CUDA plugin and libtpu are present on machines without a GPU
or TPU (they are the deviceless compilers of `--dry_run`). Left to itself, JAX then tries to start
them and prints a plugin traceback ("Jax plugin configuration error", cuInit failures) and libtpu
warnings before falling back to the CPU. Where this machine has neither an NVIDIA/AMD GPU driver
nor a TPU, the CLIs therefore start the CPU backend only; the deviceless compilers still load
when a dry run asks for them. A JAX_PLATFORMS the user set is left alone.
"""

from __future__ import annotations

import glob
import os
import sys

# What a GPU or TPU machine has: the NVIDIA driver, AMD's kernel driver, TPU VM accelerator or
# VFIO devices.
_ACCELERATOR_MARKERS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd",
                        "/dev/accel0", "/dev/vfio/0")


def has_accelerator() -> bool:
  return (any(os.path.exists(p) for p in _ACCELERATOR_MARKERS)
          or bool(glob.glob("/dev/nvidia[0-9]*")))


# JAX lets a GPU program use 75% of the GPU's memory by default; configs are sized (and the dry
# run's verdict is) for 90% of it, so the CLIs raise the limit unless the user set one.
GPU_MEMORY_FRACTION = "0.95"


def choose_jax_platforms() -> None:
  """Starts only the CPU backend on a machine without accelerators, and lets GPU programs use
  GPU_MEMORY_FRACTION of the memory; call before JAX starts a backend (importing JAX is fine:
  it starts none)."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
  if "JAX_PLATFORMS" in os.environ or has_accelerator():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"  # for this process and the ones it starts
  if "jax" in sys.modules:  # JAX read its environment when it was imported
    sys.modules["jax"].config.update("jax_platforms", "cpu")
