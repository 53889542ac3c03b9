"""What a run is compiled for: the one table of accelerators, and target names over it.

A target is a chip and a count, named as its vendor sells it:

  h100x8, h200x64, a100x16, l4x1, b200x8     NVIDIA GPUs (xN: N GPUs; 8 per host above 8)
  rtx4090x1, rtx5090x2, a6000x4, rtxpro6000x8  workstation cards on PCIe (1-8 in one host)
  v4-8, v5p-128                              Cloud TPU, N = TensorCores (2 per chip)
  v5e-4, v6e-256                             Cloud TPU, N = chips
  cpu                                        this host's CPU devices (the tiny configs)

Each chip row holds its compiler ("gpu" via the CUDA plugin, "tpu" via libtpu, "cpu"), memory per
device, dense bf16 peak FLOP/s (for MFU, metrics.py) and what the deviceless compile needs: the
libtpu topology of a slice, or the GPU's description for XLA's GPU compiler (a
`GpuTargetConfigProto`). `devices(target)` returns the target's devices without the hardware
(jax.experimental.topologies), so `jax.jit(...).lower(...).compile()` runs that compiler here.

Memory is what the runtime can hand to a program: CUDA's total device memory; for TPUs the HBM
libtpu's compiler reports as available (its out-of-memory message, per megacore device). A
program "fits" with USABLE_FRACTION of it to spare for the runtime, collective buffers and
fragmentation. (On GPU, JAX lets a program use 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION is
raised; the CLIs set it to 0.95 unless it is set, jaxtrain/platforms.py.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re

GIB = 2 ** 30
USABLE_FRACTION = 0.90
AOT_INSTALL = "pip install 'jaxtrain[aot]'  (from a checkout: pip install -e '.[aot]')"


class TargetError(ValueError):
  """An unknown or impossible target name; the message is one line listing the valid ones."""


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """What XLA's GPU compiler needs to know of a GPU model (its `gpu_device_info`)."""
  compute_capability: tuple[int, int]
  sm_count: int
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  threads_per_sm: int
  fp32_units_per_sm: int
  l2_cache_bytes: int
  memory_bandwidth: float  # bytes/s
  clock_ghz: float


# One lane's usable bytes/s per direction by PCIe generation (8/16/32/64 GT/s; 128b/130b
# encoding from 3.0 on, 6.0's FLIT mode counted at its raw rate).
_PCIE_LANE_BYTES = {3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.877e9}


@dataclasses.dataclass(frozen=True)
class Interconnect:
  """What a device's collectives travel over inside its host (GPUs) or slice (TPUs), and its
  link to the host. Datasheets quote bidirectional totals; `bytes_per_s` is one direction per
  device (half of it), what a ring all-reduce or all-gather moves a device's bytes at."""
  kind: str  # "nvlink" | "pcie" | "ici"
  bytes_per_s: float  # one direction, over `kind`: per GPU; per chip on TPUs (v7x's 2 share it)
  pcie_gen: int = 0  # the device's host link (GPUs; 0 on TPUs, whose host link jaxtrain ignores)
  pcie_lanes: int = 0
  # Workstation cards an NVLink bridge can pair (RTX A6000): one direction per card, between the
  # two cards of a pair only; collectives over more devices still cross PCIe.
  bridge_bytes_per_s: float = 0.0

  @property
  def nvlink(self) -> bool:
    return self.kind == "nvlink"

  @property
  def pcie_bytes_per_s(self) -> float:
    """One direction of the host link (0 on TPUs)."""
    return _PCIE_LANE_BYTES.get(self.pcie_gen, 0.0) * self.pcie_lanes

  def describe(self) -> str:
    """"NVLink, 450 GB/s per direction per GPU (host: PCIe 5.0 x16)", "PCIe 4.0 x16, 31.5 GB/s
    per direction, no NVLink switch", "ICI, 600 GB/s per direction per chip"."""
    if self.kind == "ici":
      return f"ICI, {self.bytes_per_s / 1e9:.0f} GB/s per direction per chip"
    host = f"PCIe {self.pcie_gen}.0 x{self.pcie_lanes}"
    if self.kind == "nvlink":
      return f"NVLink, {self.bytes_per_s / 1e9:.0f} GB/s per direction per GPU (host: {host})"
    bridge = (f"; an NVLink bridge pairs two cards at {self.bridge_bytes_per_s / 1e9:.2f} GB/s "
              f"per direction" if self.bridge_bytes_per_s else "")
    return f"{host}, {self.bytes_per_s / 1e9:.1f} GB/s per direction, no NVLink switch{bridge}"


def _pcie(gen: int, lanes: int = 16, bridge_bytes_per_s: float = 0.0) -> Interconnect:
  """GPUs without NVLink: collectives cross the host's PCIe (peer to peer where the platform
  allows, through host memory where not: the link's rate is the best case)."""
  return Interconnect("pcie", _PCIE_LANE_BYTES[gen] * lanes, gen, lanes, bridge_bytes_per_s)


@dataclasses.dataclass(frozen=True)
class Chip:
  key: str  # target-name prefix: "h100", "v5p", ...
  name: str  # for people
  compiler: str  # "gpu" | "tpu" | "cpu"
  memory_bytes: int  # per JAX device
  peak_bf16_flops: float  # per JAX device, dense
  device_kind: str  # regex on jax's `device.device_kind`, for MFU on real hardware
  gpu: GpuSpec | None = None
  description: str = ""  # GPU: the CUDA device name the compiler sees
  # TPU: Cloud TPU counts TensorCores (v4, v5p: 2 per chip, one megacore JAX device per chip)
  # or chips (v5e, v6e); torus dims of a slice (3 for v4/v5p, 2 for v5e/v6e); valid counts.
  cores_per_chip: int = 1
  torus_dims: int = 0
  counts: tuple[int, ...] = ()
  # Dense FP8 peak FLOP/s per JAX device (datasheets); 0: no FP8 matmul units.
  peak_fp8_flops: float = 0.0
  # JAX devices per chip: 1 (a GPU; a megacore TPU chip), 2 on v7x (each TensorCore a device).
  devices_per_chip: int = 1
  mxfp8: bool = False  # block-scaled FP8 matmuls (OCP microscaling): Blackwell
  interconnect: Interconnect | None = None  # every row of CHIPS has one (a default for order)


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
  return tuple(2 ** i for i in range(lo.bit_length() - 1, hi.bit_length()))


_GPU_COUNTS = (1, 2, 4) + tuple(range(8, 16385, 8))
_WORKSTATION_COUNTS = (1, 2, 4, 8)  # cards in one box
# NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional per GPU; host link PCIe 5.0 x16 (datasheets).
_NVLINK4 = Interconnect("nvlink", 450e9, 5, 16)

CHIPS: tuple[Chip, ...] = (
    Chip("h100", "NVIDIA H100 80GB (SXM)", "gpu", 84_929_347_584, 989e12, r"h100(?!.*pcie)",
         GpuSpec((9, 0), 132, 233_472, 232_448, 2048, 128, 50 * 2 ** 20, 3.35e12, 1.98),
         "NVIDIA H100 80GB HBM3", counts=_GPU_COUNTS, peak_fp8_flops=1979e12,
         interconnect=_NVLINK4),
    Chip("h200", "NVIDIA H200 141GB", "gpu", 150_754_820_096, 989e12, r"h200",
         GpuSpec((9, 0), 132, 233_472, 232_448, 2048, 128, 50 * 2 ** 20, 4.8e12, 1.98),
         "NVIDIA H200", counts=_GPU_COUNTS, peak_fp8_flops=1979e12, interconnect=_NVLINK4),
    Chip("b200", "NVIDIA B200 180GB", "gpu", 192_265_846_784, 2250e12, r"b200",
         GpuSpec((10, 0), 148, 233_472, 232_448, 2048, 128, 126 * 2 ** 20, 8.0e12, 1.965),
         "NVIDIA B200", counts=_GPU_COUNTS, peak_fp8_flops=4500e12, mxfp8=True,
         # NVLink 5: 1.8 TB/s bidirectional per GPU; host link PCIe 6.0 x16 (B200 datasheet).
         interconnect=Interconnect("nvlink", 900e9, 6, 16)),
    Chip("a100", "NVIDIA A100 80GB", "gpu", 85_051_572_224, 312e12, r"a100",
         GpuSpec((8, 0), 108, 167_936, 166_912, 2048, 64, 40 * 2 ** 20, 2.039e12, 1.41),
         "NVIDIA A100-SXM4-80GB", counts=_GPU_COUNTS,
         # NVLink 3: 600 GB/s bidirectional per GPU; PCIe 4.0 x16 (A100 datasheet).
         interconnect=Interconnect("nvlink", 300e9, 4, 16)),
    Chip("l4", "NVIDIA L4 24GB", "gpu", 24_152_899_584, 121e12, r"\bl4\b",
         GpuSpec((8, 9), 58, 102_400, 101_376, 1536, 128, 48 * 2 ** 20, 0.3e12, 2.04),
         "NVIDIA L4", counts=_GPU_COUNTS, peak_fp8_flops=242.5e12,
         interconnect=_pcie(4)),  # PCIe 4.0 x16, no NVLink (L4 datasheet)
    # The workstation cards (1-8 per host on PCIe). Memory as CUDA reports the card's total;
    # bf16 peaks are the tensor rate with float32 accumulation, dense (what a bf16 matmul
    # with an f32 result runs at: GeForce cards run it at half their fp16-accumulate rate).
    # RTX 4090, Ada AD102 (NVIDIA Ada Lovelace architecture whitepaper, appendix table):
    # 128 SMs, 2.52 GHz boost, 72 MB L2, 1008 GB/s GDDR6X, 165.2 dense BF16 / 330.3 dense FP8
    # TFLOPS with FP32 accumulate; PCIe 4.0 x16, no NVLink.
    Chip("rtx4090", "NVIDIA GeForce RTX 4090 24GB", "gpu", int(23.65 * GIB), 165.2e12,
         r"rtx\s*4090",
         GpuSpec((8, 9), 128, 102_400, 101_376, 1536, 128, 72 * 2 ** 20, 1.008e12, 2.52),
         "NVIDIA GeForce RTX 4090", counts=_WORKSTATION_COUNTS, peak_fp8_flops=330.3e12,
         interconnect=_pcie(4)),
    # RTX 5090, Blackwell GB202 (NVIDIA RTX Blackwell GPU architecture whitepaper): 170 SMs,
    # 2.41 GHz boost, 96 MB L2, 1792 GB/s GDDR7, 209.5 dense BF16 / 419 dense FP8 TFLOPS with
    # FP32 accumulate; PCIe 5.0 x16, no NVLink. sm_120's block-scaled MMA is not one XLA
    # emits for this compute capability, so no mxfp8 here.
    Chip("rtx5090", "NVIDIA GeForce RTX 5090 32GB", "gpu", int(31.37 * GIB), 209.5e12,
         r"rtx\s*5090",
         GpuSpec((12, 0), 170, 102_400, 101_376, 1536, 128, 96 * 2 ** 20, 1.792e12, 2.41),
         "NVIDIA GeForce RTX 5090", counts=_WORKSTATION_COUNTS, peak_fp8_flops=419e12,
         interconnect=_pcie(5)),
    # RTX A6000, Ampere GA102 (NVIDIA RTX A6000 datasheet): 84 SMs, 1.80 GHz boost, 6 MB L2,
    # 768 GB/s GDDR6, 309.7 sparse = 154.8 dense BF16 TFLOPS (professional cards accumulate
    # in FP32 at full rate), no FP8; PCIe 4.0 x16; a 2-way NVLink bridge, 112.5 GB/s
    # bidirectional.
    Chip("a6000", "NVIDIA RTX A6000 48GB", "gpu", int(47.54 * GIB), 154.8e12, r"rtx\s*a6000",
         GpuSpec((8, 6), 84, 102_400, 101_376, 1536, 128, 6 * 2 ** 20, 0.768e12, 1.80),
         "NVIDIA RTX A6000", counts=_WORKSTATION_COUNTS,
         interconnect=_pcie(4, bridge_bytes_per_s=56.25e9)),
    # RTX PRO 6000 Blackwell (Workstation / Max-Q / Server Edition; NVIDIA RTX PRO 6000
    # Blackwell datasheet): 188 SMs, 2.617 GHz boost, 128 MB L2, 1792 GB/s GDDR7, 96 GB;
    # "4000 AI TOPS" is FP4 with sparsity: dense FP4 2000, FP8 1000, BF16 500 TFLOPS (full-rate
    # FP32 accumulate); PCIe 5.0 x16, no NVLink.
    Chip("rtxpro6000", "NVIDIA RTX PRO 6000 Blackwell 96GB", "gpu", int(94.97 * GIB), 500e12,
         r"rtx\s*pro\s*6000",
         GpuSpec((12, 0), 188, 102_400, 101_376, 1536, 128, 128 * 2 ** 20, 1.792e12, 2.617),
         "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", counts=_WORKSTATION_COUNTS,
         peak_fp8_flops=1000e12, interconnect=_pcie(5)),
    # JAX reports v5e as "TPU v5 lite", v6e as "TPU v6 lite", v5p as "TPU v5p" or "TPU v5".
    Chip("v4", "TPU v4", "tpu", int(30.75 * GIB), 275e12, r"tpu\s*v4(?!\s*lite|i)", cores_per_chip=2,
         torus_dims=3, counts=_powers_of_two(8, 4096),
         interconnect=Interconnect("ici", 300e9)),  # half of v5p's (Cloud TPU: v5p doubles it)
    Chip("v5p", "TPU v5p", "tpu", int(95.74 * GIB), 459e12, r"tpu\s*v5(p\b|$)", cores_per_chip=2,
         torus_dims=3, counts=_powers_of_two(8, 8192),
         interconnect=Interconnect("ici", 600e9)),  # 1200 GB/s bidirectional (Cloud TPU docs)
    Chip("v5e", "TPU v5e", "tpu", int(15.75 * GIB), 197e12, r"tpu\s*v5\s*(lite|e\b)", torus_dims=2,
         counts=(1,) + _powers_of_two(4, 256),
         interconnect=Interconnect("ici", 200e9)),  # 400 GB/s bidirectional (Cloud TPU docs)
    Chip("v6e", "TPU v6e", "tpu", int(31.25 * GIB), 918e12, r"tpu\s*v6\s*(lite|e\b)", torus_dims=2,
         counts=(1,) + _powers_of_two(4, 256),
         interconnect=Interconnect("ici", 400e9)),  # 800 GB/s bidirectional (Cloud TPU docs)
    # Ironwood: two TensorCores per chip, each its own JAX device with half the chip's 192 GB
    # (libtpu reports 94.75 GiB available) and half its peaks (2307 TFLOP/s bf16, 4614 fp8).
    Chip("tpu7x", "TPU v7x", "tpu", int(94.75 * GIB), 1153.5e12, r"tpu\s*7x", cores_per_chip=2,
         torus_dims=3, counts=_powers_of_two(8, 16384), peak_fp8_flops=2307e12,
         devices_per_chip=2,
         interconnect=Interconnect("ici", 600e9)),  # 1.2 TB/s bidirectional, 1.5x v6e's
)
# Known for MFU only (no target name): datasheet peaks (bf16, fp8) of chips a run may land on.
OTHER_PEAKS: tuple[tuple[str, str, float, float], ...] = (
    (r"h100.*pcie", "NVIDIA H100 PCIe", 756e12, 1513e12),
)
_BY_KEY = {c.key: c for c in CHIPS}


@dataclasses.dataclass(frozen=True)
class Target:
  """A named count of one chip, or this host's CPU ("cpu")."""
  name: str
  chip: Chip | None  # None for "cpu"
  count: int  # as named: GPUs, TPU cores (v4/v5p) or chips (v5e/v6e)

  @property
  def compiler(self) -> str:
    return self.chip.compiler if self.chip else "cpu"

  @property
  def num_devices(self) -> int:
    """JAX devices: one per GPU, per TPU chip (megacore) or TensorCore (v7x), or this
    process's CPU devices."""
    if self.chip is None:
      import jax  # pylint: disable=import-outside-toplevel
      return len(jax.devices("cpu"))
    return self.count // self.chip.cores_per_chip * self.chip.devices_per_chip

  @property
  def memory_bytes(self) -> int:
    """Memory per device; for "cpu", this host's available memory shared by its devices."""
    if self.chip is None:
      return host_available_bytes() // self.num_devices
    return self.chip.memory_bytes

  @property
  def usable_bytes(self) -> float:
    return self.memory_bytes * USABLE_FRACTION

  def scaled(self, factor: int) -> "Target":
    """The same chip, `factor` times as many (the next slice or host count up)."""
    sep = "x" if self.chip.compiler == "gpu" else "-"
    return parse(f"{self.chip.key}{sep}{self.count * factor}")

  def describe(self) -> str:
    if self.chip is None:
      return f"this host's CPU ({self.num_devices} devices, {self.memory_bytes / GIB:.1f} GiB each)"
    unit = {"gpu": "GPUs", "tpu": "chips"}[self.chip.compiler]
    if self.chip.devices_per_chip > 1:
      unit = "TensorCores"
    return (f"{self.num_devices} {self.chip.name} {unit}, {self.memory_bytes / GIB:.1f} GiB "
            f"each")


def valid_names() -> str:
  """One line of the target names `parse` takes."""
  gpus = ", ".join(f"{c.key}xN" for c in CHIPS if c.compiler == "gpu")
  tpus = ", ".join(f"{c.key}-N" for c in CHIPS if c.compiler == "tpu")
  cards = ", ".join(c.key for c in CHIPS if c.counts == _WORKSTATION_COUNTS)
  return (f"{gpus} (N = 1, 2, 4 or a multiple of 8; {cards}: 1, 2, 4, 8); {tpus} (N as Cloud "
          f"TPU counts: cores for v4/v5p/tpu7x, chips for v5e/v6e, e.g. v5p-8, v5e-4, tpu7x-8); "
          f"cpu")


def parse(name: str) -> Target:
  """The target named `name` ("h100x8", "v5p-128", "cpu"); TargetError lists the valid ones."""
  text = str(name).strip().lower()
  if text == "cpu":
    return Target("cpu", None, 0)
  match = re.fullmatch(r"([a-z]+\d+[a-z]?)(x|-)(\d+)", text)
  chip = _BY_KEY.get(match.group(1)) if match else None
  if chip is None or match.group(2) != ("x" if chip.compiler == "gpu" else "-"):
    raise TargetError(f"unknown target {name!r}; valid targets: {valid_names()}")
  count = int(match.group(3))
  if count not in chip.counts:
    shown = ", ".join(str(n) for n in chip.counts[:12]) + (", ..." if len(chip.counts) > 12
                                                           else "")
    raise TargetError(f"target {name!r}: {chip.name} comes in counts {shown}; e.g. "
                      f"{chip.key}{match.group(2)}{chip.counts[min(3, len(chip.counts) - 1)]}")
  return Target(f"{chip.key}{match.group(2)}{count}", chip, count)


def chip_for_device_kind(device_kind: str, precision: str = "none") -> tuple[str, float] | None:
  """(name, dense peak FLOP/s) of the chip jax calls `device_kind`, or None if unknown: the
  bfloat16 peak, or with precision.matmul="fp8" the FP8 peak (0 on a chip without FP8 units)."""
  kind = device_kind.strip().lower()
  fp8 = precision in ("fp8", "mxfp8")
  for pattern, name, peak, peak_fp8 in OTHER_PEAKS:  # more specific variants first (H100 PCIe)
    if re.search(pattern, kind):
      return name, peak_fp8 if fp8 else peak
  chip = chip_of_device_kind(kind)
  if chip is None:
    return None
  return chip.name, chip.peak_fp8_flops if fp8 else chip.peak_bf16_flops


def chip_of_device_kind(device_kind: str) -> Chip | None:
  kind = device_kind.strip().lower()
  return next((c for c in CHIPS if re.search(c.device_kind, kind)), None)


def precision_refusal(precision: str, chip: Chip | None) -> str | None:
  """One line when `chip` cannot run precision.matmul=`precision` (FP8 without FP8 units, MXFP8
  without block-scaled ones); None when it can, or for this host's CPU (XLA:CPU computes FP8 by
  converting)."""
  if precision == "mxfp8" and chip is not None and not chip.mxfp8:
    have = ", ".join(c.key for c in CHIPS if c.mxfp8)
    return (f"precision.matmul='mxfp8': {chip.name} has no block-scaled (MX) FP8 matmuls; "
            f"targets that have them: {have} (or precision.matmul='fp8' for per-tensor scales)")
  if precision != "fp8" or chip is None or chip.peak_fp8_flops:
    return None
  have = ", ".join(c.key for c in CHIPS if c.peak_fp8_flops)
  return (f"precision.matmul='fp8': {chip.name} has no FP8 matmul units; targets that have "
          f"them: {have} (or precision.matmul='none')")


# --- the deviceless compilers ------------------------------------------------------------------

def compiler_missing(target: Target) -> str | None:
  """None when this process can compile for `target`; else one line saying what to install."""
  package = {"gpu": ("jax_plugins.xla_cuda12", "the CUDA plugin (jax-cuda12-plugin)"),
             "tpu": ("libtpu", "libtpu")}.get(target.compiler)
  if package is None or _installed(package[0]):
    return None
  return (f"{package[1]} is not installed, so this compiles with XLA:CPU (an estimate, not "
          f"{target.compiler.upper()} memory); for the real compiler: {AOT_INSTALL}")


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package ("jax_plugins") is not there either
    return False


def devices(target: Target) -> list:
  """The target's JAX devices, without its hardware (or this host's CPU devices for "cpu")."""
  import jax  # pylint: disable=import-outside-toplevel
  if target.chip is None:
    return jax.devices("cpu")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  if target.compiler == "tpu":
    options = _tpu_host_bounds(target)
    if target.chip.cores_per_chip == 2 and target.chip.devices_per_chip == 1:
      options["chip_config_name"] = "megacore"  # one JAX device per chip, as on the pods
    with _libtpu_outside_tpu_vms():
      topology = topologies.get_topology_desc(
          topology_name=f"{target.chip.key}:{tpu_topology(target)}", platform="tpu", **options)
  else:
    topology = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(
        target.chip), topology=gpu_topology(target))
  found = list(topology.devices)
  if len(found) != target.num_devices:
    raise TargetError(f"target {target.name}: the compiler's topology has {len(found)} devices, "
                      f"expected {target.num_devices}")
  return found


def tpu_topology(target: Target) -> str:
  """The slice's torus shape, e.g. "2x2x1" for v5p-8 (4 chips), "4x4" for v5e-16."""
  chips = target.count // target.chip.cores_per_chip
  if target.chip.torus_dims == 2:
    dims = [1, 1]
  else:  # the smallest 3-D slice is 2x2x1 (4 chips)
    dims = [2, 2, 1]
  while math.prod(dims) < chips:
    smallest = min(dims)
    last = max(i for i, d in enumerate(dims) if d == smallest)  # grow z, then y, then x
    dims[last] *= 2
  return "x".join(str(d) for d in dims)


def _tpu_host_bounds(target: Target) -> dict[str, object]:
  """Hosts of v5e/v6e slices up to 8 chips hold the whole slice (libtpu's default host is 2x2)."""
  chips = target.count // target.chip.cores_per_chip
  if target.chip.torus_dims != 2 or chips not in (1, 8):
    return {}
  return {"chips_per_host_bounds": [1, 1, 1] if chips == 1 else [2, 4, 1]}


def gpu_topology(target: Target) -> str:
  """"slices x hosts x GPUs per host": up to 8 GPUs on one host, then hosts of 8."""
  per_host = min(target.count, 8)
  return f"1x{target.count // per_host}x{per_host}"


def _package_version(name: str, default: tuple[int, int]) -> tuple[int, int]:
  try:
    major, minor = importlib.metadata.version(name).split(".")[:2]
    return int(major), int(minor)
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return default


def gpu_target_config(chip: Chip) -> str:
  """XLA's `GpuTargetConfigProto` (text format) for `chip`: the GPU the compiler plans for.

  cuDNN and CUDA versions are those installed (the aot extra), which the compiler's cuDNN
  fusions are built against.
  """
  g = chip.gpu
  cudnn = _package_version("nvidia-cudnn-cu12", (9, 8))
  cuda = _package_version("nvidia-cuda-runtime-cu12", (12, 8))
  fields = {
      "threads_per_block_limit": 1024, "threads_per_warp": 32,
      "shared_memory_per_block": 48 * 1024, "shared_memory_per_core": g.shared_memory_per_sm,
      "threads_per_core_limit": g.threads_per_sm, "core_count": g.sm_count,
      "fpus_per_core": g.fp32_units_per_sm, "block_dim_limit_x": 2 ** 31 - 1,
      "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
      "memory_bandwidth": int(g.memory_bandwidth), "l2_cache_size": g.l2_cache_bytes,
      "clock_rate_ghz": g.clock_ghz, "device_memory_size": chip.memory_bytes,
      "shared_memory_per_block_optin": g.shared_memory_per_block_optin,
      "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
  }
  info = " ".join(f"{k}: {v}" for k, v in fields.items())
  major, minor = g.compute_capability
  return (f"gpu_device_info {{ {info} cuda_compute_capability {{ major: {major} minor: {minor} }}"
          f" }} platform_name: \"CUDA\" dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}"
          f" runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }} "
          f"device_description_str: \"{chip.description}\"")


@contextlib.contextmanager
def _libtpu_outside_tpu_vms():
  """While libtpu loads: it looks for the TPU VM's metadata and prints warnings where there is
  none, which a deviceless compile does not need, so name a host for it; and it locks
  /tmp/libtpu_lockfile for a TPU it owns, which compiling owns none of, so two dry runs (or test
  workers) may compile at once. Never on a TPU VM, and only for the load: left in the process's
  environment, the host names would make the trainer's processes it starts take this machine
  for a TPU pod (jaxtrain/distributed.py)."""
  settings = {"TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost",
              "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  on_tpu_vm = os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
  added = [] if on_tpu_vm else [k for k in settings if k not in os.environ]
  os.environ.update({k: settings[k] for k in added})
  try:
    yield
  finally:
    for k in added:
      os.environ.pop(k, None)


def host_available_bytes() -> int:
  """Memory this host can still give a process (MemAvailable), for the CPU target."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# --- the verdict -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Verdict:
  status: str  # "fits" | "tight" | "does not fit"
  headroom_bytes: float  # usable memory minus the program's; negative when it does not fit

  @property
  def fits(self) -> bool:
    return self.status == "fits"


def verdict(memory_bytes: float, device_bytes: float) -> Verdict:
  """Whether a program needing `device_bytes` per device runs on devices of `memory_bytes`."""
  usable = memory_bytes * USABLE_FRACTION
  if device_bytes <= usable:
    status = "fits"
  elif device_bytes <= memory_bytes:
    status = "tight"
  else:
    status = "does not fit"
  return Verdict(status, usable - device_bytes)


def format_bytes(n: float, signed: bool = False) -> str:
  """12.34 GiB, 56.7 MiB, 8.0 KiB: GiB from 0.1 GiB up, so large figures compare at a glance."""
  sign = "+" if signed and n >= 0 else ""
  for unit, scale, digits in (("GiB", GIB, 2), ("MiB", 2 ** 20, 1), ("KiB", 2 ** 10, 1)):
    if abs(n) >= 0.1 * scale or unit == "KiB":
      return f"{sign}{n / scale:.{digits}f} {unit}"
  return ""
