"""Accelerator memory sizes and the fits / does-not-fit verdict of the dry run.

Capacities are the vendors' per-chip HBM figures. Not all of it is usable by the program: the
runtime, collective buffers and allocator fragmentation take some, so a program "fits" only with
USABLE_FRACTION of the capacity to spare; between that and the whole capacity it is "tight".
(On GPU, JAX also preallocates only 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION is raised, e.g.
to 0.95, which large runs should do.)
"""

from __future__ import annotations

import dataclasses

GIB = 2 ** 30
USABLE_FRACTION = 0.90


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  platform: str  # "gpu" | "tpu"
  memory_gib: float  # HBM per chip


ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator("H100 80GB", "gpu", 80.0),
    Accelerator("H200 141GB", "gpu", 141.0),
    Accelerator("A100 40GB", "gpu", 40.0),
    Accelerator("A100 80GB", "gpu", 80.0),
    Accelerator("TPU v5e", "tpu", 16.0),
    Accelerator("TPU v5p", "tpu", 95.0),
    Accelerator("TPU v6e", "tpu", 32.0),
)


@dataclasses.dataclass(frozen=True)
class Verdict:
  accelerator: Accelerator
  status: str  # "fits" | "tight" | "does not fit"
  headroom_gib: float  # usable memory minus the program's; negative when it does not fit

  @property
  def fits(self) -> bool:
    return self.status == "fits"


def verdict(accelerator: Accelerator, device_bytes: float) -> Verdict:
  """Whether a program needing `device_bytes` per device runs on `accelerator`."""
  need_gib = device_bytes / GIB
  usable_gib = accelerator.memory_gib * USABLE_FRACTION
  if need_gib <= usable_gib:
    status = "fits"
  elif need_gib <= accelerator.memory_gib:
    status = "tight"
  else:
    status = "does not fit"
  return Verdict(accelerator, status, usable_gib - need_gib)


def verdicts(device_bytes: float) -> list[Verdict]:
  return [verdict(a, device_bytes) for a in ACCELERATORS]


def format_bytes(n: float, signed: bool = False) -> str:
  """12.34 GiB, 56.7 MiB, 8.0 KiB: GiB from 0.1 GiB up, so large figures compare at a glance."""
  sign = "+" if signed and n >= 0 else ""
  for unit, scale, digits in (("GiB", GIB, 2), ("MiB", 2 ** 20, 1), ("KiB", 2 ** 10, 1)):
    if abs(n) >= 0.1 * scale or unit == "KiB":
      return f"{sign}{n / scale:.{digits}f} {unit}"
  return ""
