"""The dry run's collectives section: what the compiled step moves between devices per step, and
an estimate of the time that takes over the target's interconnect, next to its matmuls at peak.

Bytes per device and kind come from the optimized HLO (train/hlo_collectives.py: every loop body
once per iteration); the time is the ring algorithm's share of them over the chip's link rate
per direction (hardware.Interconnect: NVLink, PCIe or ICI, from datasheets), collectives one
after another. Both times are estimates, labelled so: a real step overlaps collectives with
compute where XLA's scheduler can, adds latency, and rarely runs matmuls at peak.

On PCIe (workstation cards, L4) tensor parallelism's per-layer collectives of activations cost
the most: with mesh.tensor > 1 the dry run also compiles the same devices on fsdp instead and
prints what that moves (suggestions.layout_alternative), and the suggestions carry each compiled
option's collectives.
"""

from __future__ import annotations

from jaxtrain.hardware import Target, format_bytes
from jaxtrain.train import hlo_collectives
from jaxtrain.train import measure as aot

HEADER = ("collectives per step (per device; ESTIMATE from the compiled HLO and the link's "
          "datasheet rate, not a measurement):")
GPUS_PER_HOST = 8  # hardware.gpu_topology: hosts of 8 GPUs above 8


def link_bytes_per_s(target: Target | None) -> float | None:
  """One direction of the link per JAX device (v7x's two TensorCores share their chip's); None
  without a target chip."""
  chip = target.chip if target is not None else None
  if chip is None or chip.interconnect is None:
    return None
  return chip.interconnect.bytes_per_s / chip.devices_per_chip


def over_pcie(target: Target | None) -> bool:
  chip = target.chip if target is not None else None
  return chip is not None and chip.interconnect is not None and chip.interconnect.kind == "pcie"


def peak(m: aot.Measurement, target: Target) -> tuple[float, str]:
  """(dense peak FLOP/s per device, its precision) the step's matmuls run at on the target."""
  chip = target.chip
  if m.model_cfg.runtime.matmul_precision in ("fp8", "mxfp8") and chip.peak_fp8_flops:
    return chip.peak_fp8_flops, "fp8"
  return chip.peak_bf16_flops, "bf16"


def format_seconds(s: float) -> str:
  if s >= 1:
    return f"{s:.2f} s"
  if s >= 1e-3:
    return f"{s * 1e3:.1f} ms"
  if s >= 1e-6:
    return f"{s * 1e6:.1f} µs"
  return f"{s * 1e9:.0f} ns"


def counted(m: aot.Measurement) -> hlo_collectives.HloCollectives:
  return hlo_collectives.count(m.hlo)


def section(m: aot.Measurement, target: Target | None) -> list[str]:
  """The report's lines: one row per kind (instructions executed, replica group sizes, bytes,
  bytes over the link, time at the link's rate), the total, the matmuls at peak, which is
  larger; bytes only without a target chip."""
  found = counted(m)
  if not found.kinds:
    return ["", "collectives per step: none in the compiled program"
                + (" (one device)" if m.num_devices == 1 else "")]
  rate = link_bytes_per_s(target)
  if rate is None:
    lines = ["", "collectives per step (per device, from the compiled HLO; no target chip, so "
                 "no link rate and no time):"]
  else:
    lines = ["", HEADER, f"  link: {target.chip.interconnect.describe()}"]
  lines.append(f"  {'kind':<19} {'executed':>9} {'groups':>7} {'bytes':>12} {'over the link':>14}"
               + (f" {'time':>10}" if rate else ""))
  for k in found.kinds:
    groups = ",".join(map(str, k.group_sizes)) or "pairs"
    lines.append(f"  {k.kind:<19} {k.executed:>9,} {groups:>7} {format_bytes(k.bytes):>12} "
                 f"{format_bytes(k.link_bytes):>14}"
                 + (f" {format_seconds(k.seconds(rate)):>10}" if rate else ""))
  lines.append(f"  {'total':<19} {found.executed:>9,} {'':>7} {format_bytes(found.bytes):>12} "
               f"{format_bytes(found.link_bytes):>14}"
               + (f" {format_seconds(found.seconds(rate)):>10}" if rate else ""))
  if rate:
    lines += _against_compute(m, target, found.seconds(rate))
    lines += _notes(m, target, found)
  lines += ["  (bytes: all-gather's gathered result, reduce-scatter's input, the others' "
            "operand; over the link:",
            "  a ring's share of them, (n-1)/n for a group of n, 2(n-1)/n for an all-reduce, "
            "all for a permute)"]
  return lines


def _against_compute(m: aot.Measurement, target: Target, link_s: float) -> list[str]:
  flops, precision = peak(m, target)
  compute_s = m.flops / flops if flops else 0.0
  lines = [f"  matmuls at peak     {m.flops:.3e} FLOPs at {flops / 1e12:,.0f} TFLOP/s "
           f"({precision}, dense): {format_seconds(compute_s)}"]
  if compute_s:
    lines += [f"  collectives dominate: {link_s / compute_s:.1f}x the matmuls' time at peak"
              if link_s > compute_s else f"  compute dominates: the collectives need "
              f"{100 * link_s / compute_s:.0f}% of the matmuls' time at peak",
              "  (XLA overlaps collectives with compute where it can; the larger of the two "
              "bounds the step)"]
  return lines


def _notes(m: aot.Measurement, target: Target, found) -> list[str]:
  chip, lines = target.chip, []
  if chip.compiler == "gpu" and m.num_devices > GPUS_PER_HOST:
    lines += [f"  note: {m.num_devices} GPUs are {m.num_devices // GPUS_PER_HOST} hosts: groups "
              f"spanning hosts cross the network, which the chip table does not know;",
              "  the times take every collective at the in-host link's rate (a lower bound)"]
  bridge = chip.interconnect.bridge_bytes_per_s
  if bridge and m.num_devices == 2:
    lines.append(f"  with the NVLink bridge pairing the two cards ({bridge / 1e9:.2f} GB/s per "
                 f"direction): {format_seconds(found.seconds(bridge))}")
  if m.backend != m.platform:
    lines += ["  note: XLA:CPU's program (the target's compiler is not installed): the "
              "partitioner's collectives,", "  which the target's compiler combines and "
              "schedules its own way"]
  return lines


def brief(m: aot.Measurement, target: Target) -> str:
  """One line of a compiled option's collectives and their time at the target's link rate."""
  if not m.hlo:
    return "not compiled (the compiler refused the program)"
  found, rate = counted(m), link_bytes_per_s(target)
  flops, _ = peak(m, target)
  return (f"{format_bytes(found.link_bytes)} over the link per device per step, "
          f"~{format_seconds(found.seconds(rate))} at {rate / 1e9:.1f} GB/s; matmuls at peak "
          f"~{format_seconds(m.flops / flops)} (estimates)")
