"""What differs between the JAX releases jaxtrain supports, each difference named once.

jaxtrain runs on jax 0.10.2 (the newest release for Python 3.11) and jax 0.12 (Python 3.12+;
pyproject.toml). Code that must behave differently on the two asks this module, never
`jax.__version__` itself, so the list below is the whole of what an upgrade changed:

- XLA:CPU's classic LLVM IR emitters (`xla_cpu_use_fusion_emitters=false`) exist in jax 0.10's
  XLA only; jax 0.12's XLA has the MLIR fusion emitters alone and aborts the process on the
  flag (`cpu_emitter_options`, `cpu_classic_emitter_flag`).
- Pallas's Triton lowering reads the GPU's kind from the device it lowers for: jax 0.12 raises
  "No supported GPU devices found" on a host without a GPU unless an abstract mesh names one;
  jax 0.10 lowered without asking (`gpu_lowering_context`). A deviceless compile for a GPU
  target (jaxtrain/hardware.py) has the compiler's own devices and needs nothing here.
- XLA:GPU's cuDNN block-scaled GEMM (MXFP8, `jax.nn.scaled_matmul`): jax 0.10's compiler
  builds it in a deviceless compile; jax 0.12's asks cuDNN's runtime engine for a plan, which
  needs the GPU driver, so on a host without a GPU it computes the product as dequantized bf16
  dots instead (`deviceless_block_scaled_gemm`; the dry run's matmul row says which it got).

The version is read from the installed package's metadata, not by importing JAX: XLA_FLAGS
must be final before JAX starts a backend, and callers set them from what this module says.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import re

import jax  # importing starts no backend: XLA_FLAGS may still be set after this


@functools.cache
def jax_version() -> tuple[int, int, int]:
  """The installed jax's (major, minor, patch); "0.12.0.1" -> (0, 12, 0)."""
  numbers = re.findall(r"\d+", importlib.metadata.version("jax"))[:3]
  return tuple(int(n) for n in numbers + ["0"] * (3 - len(numbers)))  # type: ignore[return-value]


def has_classic_cpu_emitters() -> bool:
  """Whether XLA:CPU can compile with its classic LLVM IR emitters instead of the MLIR fusion
  emitters: jax 0.10's XLA can (and compiles small programs about three times faster with
  them); jax 0.12's removed the flag."""
  return jax_version() < (0, 12, 0)


def cpu_classic_emitter_flag() -> str:
  """The XLA_FLAGS entry that picks the classic emitters, or "" where XLA has none."""
  return "--xla_cpu_use_fusion_emitters=false" if has_classic_cpu_emitters() else ""


def cpu_emitter_options(fusion_emitters: bool) -> dict:
  """Compile options (`Lowered.compile(options)`) for XLA:CPU's emitters: {} where the choice
  does not exist (jax 0.12: always the fusion emitters)."""
  return {"xla_cpu_use_fusion_emitters": fusion_emitters} if has_classic_cpu_emitters() else {}


def gpu_lowering_context(device_kind: str = "NVIDIA H100 80GB HBM3", num_cores: int = 132):
  """A context in which `lower(lowering_platforms=("cuda",))` of Pallas GPU kernels works on a
  host without a GPU: on jax 0.12 an abstract one-device mesh of `device_kind` (H100 SXM by
  default: 132 SMs); on jax 0.10, where the lowering asks nothing, no context at all."""
  if jax_version() < (0, 12, 0):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores,
                                       platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device))


def deviceless_block_scaled_gemm() -> bool:
  """Whether XLA:GPU emits cuDNN's block-scaled GEMM for an MXFP8 product when it compiles for
  a GPU target on a host without one: jax 0.10 does; jax 0.12's plan search needs libcuda
  (`--xla_gpu_cudnn_deviceless_compilation_mode` cannot lift that), and falls back to
  dequantizing the e4m3 operands and their e8m0 scales into a bf16 dot."""
  return jax_version() < (0, 12, 0)


def pallas_gpu_lowering_knows(device_kind: str) -> bool:
  """Whether Pallas's Triton lowering can compile our kernels for a GPU called `device_kind`
  without the card: jax 0.12 looks the name up in its table of cards
  (`jax._src.pallas.triton.gpu_info.GpuVersion`) and, for a name outside it, asks the concrete
  device, which a deviceless compile does not have; jax 0.10 lowers without asking."""
  if jax_version() < (0, 12, 0):
    return True
  # pylint: disable-next=import-outside-toplevel  (a private module, on jax 0.12 only)
  from jax._src.pallas.triton import gpu_info
  return gpu_info.gpu_version_from_device_kind(device_kind) is not None
