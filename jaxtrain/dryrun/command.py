"""`--dry_run`: does this config fit its target? Answered from a laptop, by the target's compiler.

`python -m jaxtrain.main --config=configs/llama8b.py --dry_run` compiles the real train step for
the config's `target` (or `--dry_run_target=NAME`) with that target's own compiler, without its
hardware (jaxtrain/hardware.py: libtpu for TPUs, XLA's GPU compiler for GPUs), on abstract inputs;
then prints per-device memory, FLOPs per step, the collectives per step with an estimate of their
time over the target's interconnect (interconnect.py), the parameter shardings, the verdict, and,
where it does not fit, changes that make it fit, each measured by the same compiler
(suggestions.py). The last line is for scripts:

  dry_run: target=NAME compiler=gpu|tpu|cpu devices=N params_gib=X opt_gib=X temp_gib=X
           total_gib=X fits=yes|no   (one line)

(opt_gib: optimizer state in device memory; total_gib: all device memory per device; fits: with
targets.USABLE_FRACTION of the device's memory to spare.) When the target's compiler is not
installed, XLA:CPU models it (an estimate; one line says so and how to install the compiler).
`--dry_run_devices=N` models an unnamed accelerator on N emulated CPU devices (`target=none
compiler=cpu`), judged against the config's target's memory. Emulated devices need a fresh
process: the command re-runs itself with `--xla_force_host_platform_device_count=N`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

from jaxtrain import compat
from jaxtrain import hardware as targets
from jaxtrain import objectives
from jaxtrain.config import ConfigError
from jaxtrain.dryrun import hlo_dots
from jaxtrain.dryrun import interconnect
from jaxtrain.dryrun import suggestions
from jaxtrain.hardware import GIB, Target, format_bytes, verdict
from jaxtrain.models.config import ModelConfig
from jaxtrain.ops.attention import (CUDNN_MAX_HEAD_DIM, context_kernel_platform, cudnn_takes,
                                    impl_that_runs)
from jaxtrain.parallel import pipeline
from jaxtrain.parallel.mesh import platform_of_backend
from jaxtrain.train import measure as aot
from jaxtrain.train import memory_breakdown as breakdown
from jaxtrain.train import metrics
from jaxtrain.validation.checks import validate

_CHILD_ENV = "JAXTRAIN_DRY_RUN_CHILD"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass
class Result:
  base: aot.Measurement
  fits: bool
  options: list[suggestions.Option]
  last_line: str


def resolve_target(name: str) -> Target:
  """The target a config or flag names; ConfigError (one line, the valid names) if unknown."""
  try:
    return targets.parse(name)
  except targets.TargetError as e:
    raise ConfigError(str(e)) from None


def main(config, num_devices: int | None, target_name: str | None = None,
         config_name: str = "", hlo_path: str | None = None) -> int:
  """CLI entry (main.py --dry_run). Returns the exit code; ConfigError propagates. `hlo_path`:
  where to write the compiled step's optimized HLO text (--dry_run_hlo)."""
  import jax  # pylint: disable=import-outside-toplevel  (after main.py set up the process)
  if num_devices is not None and target_name:
    raise ConfigError("--dry_run_devices and --dry_run_target: give one (a target compiles with "
                      "its own compiler; devices emulate an unnamed accelerator on CPU)")
  if num_devices is not None and num_devices < 1:
    raise ConfigError(f"--dry_run_devices={num_devices}: must be a positive device count")
  target = None if num_devices is not None else resolve_target(target_name or config.target)
  refusal = (targets.precision_refusal(config.precision.matmul, target and target.chip)
             or _pallas_lowering_refusal(config, target))
  if refusal:
    raise ConfigError(refusal)
  if target is not None and target.chip is not None:
    missing = targets.compiler_missing(target)
    if missing is None:
      run(config, targets.devices(target), target, config_name, hlo_path=hlo_path)
      return 0
    if not os.environ.get(_CHILD_ENV):
      print(f"note: {missing}", flush=True)
    num_devices = target.num_devices  # XLA:CPU models the target on as many CPU devices
  cpu_devices = jax.devices("cpu")
  n = num_devices or len(cpu_devices)
  validate(config, n, _platform_for(cpu_devices, target), for_run=False)
  if n > len(cpu_devices):
    if os.environ.get(_CHILD_ENV):
      raise RuntimeError(f"asked for {n} emulated CPU devices, got {len(cpu_devices)}")
    return _rerun_with_cpu_devices(n)
  run(config, cpu_devices[:n], target, config_name, hlo_path=hlo_path)
  return 0


def _pallas_lowering_refusal(config, target: Target | None) -> str | None:
  """One line when the step would run our Pallas GPU kernels on a card this JAX's Pallas
  lowering cannot compile them for without the card (compat.pallas_gpu_lowering_knows); None
  otherwise. A run on the card itself lowers them: only the deviceless compile is refused."""
  chip = target.chip if target is not None else None
  if (chip is None or chip.gpu is None or targets.compiler_missing(target)
      or compat.pallas_gpu_lowering_knows(chip.description)):
    return None
  impl = config.attention.impl
  head_dim = ModelConfig.from_config(config, platform="gpu").arch.head_dim
  resolved = impl_that_runs(impl, "gpu", head_dim, config.mesh.stage)
  if config.mesh.context > 1:
    kernels = context_kernel_platform(resolved, "gpu") is not None
    why = "context-parallel attention on GPU runs our Pallas kernels, and "
  else:
    kernels = resolved == "pallas"
    why = ("" if impl == "pallas" else
           f"cuDNN takes head dims up to {CUDNN_MAX_HEAD_DIM}, not {head_dim}, so auto runs our "
           f"Pallas kernels, and " if not cudnn_takes(head_dim) else
           "pipeline stages turn cuDNN into our Pallas kernels, and ")
  if not kernels:
    return None
  cudnn_would = config.mesh.context == 1 and config.mesh.stage == 1 and cudnn_takes(head_dim)
  major, minor = chip.gpu.compute_capability
  same = [f"{c.key}x{target.num_devices}" for c in targets.CHIPS
          if c.gpu is not None and c.key != chip.key
          and c.gpu.compute_capability == chip.gpu.compute_capability
          and compat.pallas_gpu_lowering_knows(c.description)]
  version = ".".join(map(str, compat.jax_version()))
  instead = "cudnn" if cudnn_would else "xla"
  return (f"attention.impl={impl!r} on {chip.name}: {why}jax {version}'s Pallas GPU lowering "
          f"has no entry for this card, so our kernels cannot be compiled for it without one; "
          f"use attention.impl={instead!r}"
          + (f", or dry-run {' / '.join(same)} (the same sm_{major}{minor})" if same else "")
          + ", or dry-run on jax 0.10 (Python 3.11)")


def _rerun_with_cpu_devices(n: int) -> int:
  """The same command in a fresh process whose CPU backend has `n` devices (the device count is
  fixed when JAX starts its backend, which this process already did)."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  env["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={n}"])
  env["JAX_PLATFORMS"] = "cpu"
  env[_CHILD_ENV] = "1"
  env.pop("JAX_COORDINATOR_ADDRESS", None)  # one process compiles; nothing to coordinate
  print(f"dry run: re-running with {n} emulated CPU devices", flush=True)
  return subprocess.run([sys.executable, "-m", "jaxtrain.main", *sys.argv[1:]], env=env,
                        check=False).returncode


def _platform_for(devices, target: Target | None) -> str:
  """What the run is for: the devices' own platform, the named target's (modelled on CPU when its
  compiler is missing), or an unnamed accelerator (bfloat16, fused attention) on CPU."""
  if devices[0].platform != "cpu":
    return platform_of_backend(devices[0].platform)
  if target is None:
    return "gpu"
  return target.compiler


def memories_for(target: Target | None, config) -> suggestions.Memories:
  """The device memory sizes the verdict is for: the target's; for an unnamed accelerator, every
  chip of the table, and the config's target first."""
  if target is not None:
    return {target.name: target.memory_bytes}
  table = {c.name: c.memory_bytes for c in targets.CHIPS}
  own = targets.parse(config.target)
  if own.chip is not None:
    table = {own.chip.name: own.chip.memory_bytes, **table}
  return table


def run(config, devices, target: Target | None, config_name: str = "", out=None,
        hlo_path: str | None = None) -> Result:
  """Measures `config` on `devices` for `target` (None: an unnamed accelerator modelled on CPU
  devices), prints the report through `out`, returns the figures; writes the compiled step's
  optimized HLO text to `hlo_path` when given."""
  out = out or (lambda line: print(line, flush=True))
  start = time.perf_counter()
  base = aot.measure(config, devices, _platform_for(devices, target), with_breakdown=True)
  if hlo_path:
    with open(hlo_path, "w", encoding="utf-8") as f:
      f.write(base.hlo)
  table = memories_for(target, config)
  judged_name, judged = next(iter(table.items()))
  fits = verdict(judged, base.total).fits
  for line in (_describe(config, base, config_name, target)
               + suggestions.layout_alternative(config, devices, base, target)):
    out(line)
  out("")
  out(f"verdict: {format_bytes(base.total)} per device needed; 'fits' leaves "
      f"{100 - 100 * targets.USABLE_FRACTION:.0f}% of the memory to the runtime")
  for name, memory in table.items():
    v = verdict(memory, base.total)
    out(f"  {name:<24} {memory / GIB:>6.1f} GiB  {v.status:<13} headroom "
        f"{format_bytes(v.headroom_bytes, signed=True)}")
  options: list[suggestions.Option] = []
  if not all(verdict(memory, base.total).fits for memory in table.values()):
    out("")
    out("suggestions: changes that make it fit, with their per-device totals ('compiled': "
        "measured")
    out(f"like the above, by {_compiler_name(base)}; 'exact': arithmetic on exact bytes; "
        f"'estimate': as described)")
    options = suggestions.options(config, devices, base, table, target)
    for line in suggestions.describe(options, base, table):
      out(line)
  last = last_line(base, target, fits)
  if hlo_path:
    out("")
    out(f"optimized HLO of the compiled step ({_compiler_name(base)}): {hlo_path}")
  out("")
  out(f"dry run took {time.perf_counter() - start:.1f} s"
      + ("" if target is not None else f"; fits= judged against {judged_name}"))
  out(last)
  return Result(base, fits, options, last)


def last_line(m: aot.Measurement, target: Target | None, fits: bool) -> str:
  """The line scripts read (the contract in the module docstring)."""
  return (f"dry_run: target={target.name if target is not None else 'none'} "
          f"compiler={m.backend} devices={m.num_devices} "
          f"params_gib={_number(m.params / GIB)} opt_gib={_number(m.opt_device / GIB)} "
          f"temp_gib={_number(m.temp / GIB)} total_gib={_number(m.total / GIB)} "
          f"fits={'yes' if fits else 'no'}")


def _matmul_row(precision: str, hlo: str) -> str:
  """What the compiled step multiplies in low precision (the optimized HLO's dots by type)."""
  counts = hlo_dots.dot_operand_types(hlo)
  if precision == "mxfp8":
    kernels = hlo_dots.block_scaled_dots(hlo)
    dequantized = max(0, hlo_dots.block_scaled_matmuls(hlo) - kernels)
    row = (f"mxfp8: {kernels + dequantized} block-scaled matmuls (e4m3 with an e8m0 scale per "
           f"32), {sum(counts.values()) - dequantized} other dots in the compiled step (a loop "
           f"body once)")
    if dequantized:
      row += (f"; {dequantized} of the block-scaled ones compiled as dequantized bf16 dots, "
              f"{kernels} as block-scaled GEMMs")
      if not compat.deviceless_block_scaled_gemm():
        row += (" (this jax's XLA:GPU plans cuDNN's block-scaled GEMM only with a GPU driver, so "
                "a deviceless compile cannot show the kernel)")
    return row
  return f"{precision}: {hlo_dots.describe(counts)} dots in the compiled step (a loop body once)"


def _number(x: float) -> str:
  """Four decimals for GiB-sized figures, six significant digits for tiny test models."""
  return f"{x:.4f}" if x >= 0.1 else f"{x:.6g}"


PEAK_ROWS = 12


def _peak_lines(m: aot.Measurement) -> list[str]:
  """The largest temporaries live at the memory peak, from the compiler's buffer assignment
  (train/memory_breakdown.py): what to shrink when a config does not fit."""
  b = m.breakdown
  if b is None:
    return []
  temps = b.temporaries()
  lines = ["", f"largest temporaries at the memory peak ({_compiler_name(m)}'s buffer "
               f"assignment; {format_bytes(b.peak_bytes)} live there, arguments included):"]
  for t in temps[:PEAK_ROWS]:
    lines.append(f"  {format_bytes(t.size):>11}  {t.shape:<26} {t.opcode:<12} "
                 f"{breakdown.describe_source(t.source)}")
  rest = temps[PEAK_ROWS:]
  if rest:
    lines.append(f"  {format_bytes(sum(t.size for t in rest)):>11}  {len(rest)} smaller "
                 f"buffers")
  return lines


def _compiler_name(m: aot.Measurement) -> str:
  return {"gpu": "XLA's GPU compiler", "tpu": "libtpu's TPU compiler", "cpu": "XLA:CPU"}[m.backend]


def _describe(config, m: aot.Measurement, config_name: str, target: Target | None) -> list[str]:
  """The run table, parameter shardings, memory and FLOPs of the base measurement."""
  cfg, t, o = m.model_cfg, config.train, config.optim
  shards = m.mesh.batch_shards
  microbatch = t.global_batch_size // (shards * t.grad_accum_steps)
  stages = m.mesh.stage
  micro = pipeline.resolve_microbatches(config.pipeline.microbatches, stages)
  if m.backend == m.platform:
    where = (f"{target.describe() if target is not None else f'{m.num_devices} devices'}, by "
             f"{_compiler_name(m)}" + (" (no device needed)" if m.backend != "cpu" else ""))
  else:
    modelled = target.describe() if target is not None else "an accelerator"
    where = f"{m.num_devices} emulated CPU devices (XLA:CPU), modelling {modelled}"
  rows = [
      ("config", config_name or "(from flags)"),
      ("target", target.name if target is not None else "none (--dry_run_devices)"),
      ("compiled for", where),
      ("parameters", f"{metrics.format_count(metrics.count_params(cfg.arch))} "
                     f"({metrics.count_params(cfg.arch):,}); {cfg.arch.describe()}"),
      *filter(None, [metrics.moe_row(cfg, m.mesh.expert)]),
      ("mesh", m.mesh.describe()),
      ("batch", f"global {t.global_batch_size} seq × {t.seq_len}; per device "
                f"{t.global_batch_size // shards} seq, "
                + (f"{micro} pipeline microbatches of {t.global_batch_size // shards // micro}"
                   if stages > 1 else f"microbatch {microbatch}")
                + f" (grad accum {t.grad_accum_steps})"),
      *([("pipeline", pipeline.describe(stages, cfg.arch.num_layers, micro, config.pipeline.repeats,
                                        t.global_batch_size / shards))] if stages > 1 else []),
      ("dtypes", f"params {cfg.runtime.param_dtype}, compute {cfg.runtime.dtype}, "
                 f"{suggestions.STATE_NAMES[o.name]} {o.state_dtype} in "
                 f"{'pinned host' if o.offload_state else 'device'} memory"
                 + (f" ({m.offload_note})" if m.offload_note else "")),
      ("remat", cfg.runtime.remat_policy + (f" ({m.remat_note})" if m.remat_note else "")),
      *([("matmuls", _matmul_row(cfg.runtime.matmul_precision, m.hlo))]
        if cfg.runtime.matmul_precision != "none" else []),
      ("attention", m.attention_note),
      ("compile", f"{m.compile_s:.1f} s"),
  ]
  lines = [metrics.format_table(rows, title="jaxtrain dry run"), "",
           "parameter shardings (PartitionSpec over mesh axes; per-device bytes):"]
  width = max(len(p.path) for p in m.param_shards)
  for p in m.param_shards:
    shape = "[" + ", ".join(str(d) for d in p.shape) + "]"
    lines.append(f"  {p.path:<{width}}  {shape:<22} {p.dtype:<8} {p.spec:<34} "
                 f"{format_bytes(p.device_bytes):>10}")
  exact_args = m.params + m.opt_device + m.opt_host + m.batch
  host = m.opt_host + m.act_host
  lines += [
      "", "per-device memory" + (f" (each device holds one stage: "
                                 f"{cfg.arch.num_layers // stages} of the {cfg.arch.num_layers} "
                                 f"layers)" if stages > 1 else "") + ":",
      f"  parameters       {format_bytes(m.params):>11}  exact, from the shardings"
      + (f" (trained {format_bytes(m.params - m.frozen)}, frozen {format_bytes(m.frozen)})"
         if m.frozen else ""),
      f"  optimizer state  {format_bytes(m.opt_device):>11}  exact (device memory)"
      + (f"; Muon: {format_bytes(m.adamw_opt - m.opt_device - m.opt_host)} less than AdamW's "
         f"{format_bytes(m.adamw_opt)}" if m.adamw_opt else ""),
      *([f"  reward models    {format_bytes(m.resident):>11}  exact, frozen weights "
         f"(grpo.reward_models) scoring the rollouts between steps"] if m.resident else []),
      f"  batch            {format_bytes(m.batch):>11}  exact",
      f"  temporaries      {format_bytes(m.temp):>11}  from {_compiler_name(m)}"
      + (" (see the note)" if m.backend != m.platform else "")
      + (f"'s buffer assignment (its memory_analysis() says {format_bytes(m.reported_temp)})"
         if m.reported_temp is not None else ""),
      f"  new outputs      {format_bytes(m.outputs):>11}  outputs not written over the donated "
      f"state",
      f"  total            {format_bytes(m.total):>11}  device memory needed",
      f"  host (pinned)    {format_bytes(host):>11}  optimizer state "
      f"{format_bytes(m.opt_host)}, offloaded activations {format_bytes(m.act_host)}",
      f"  cross-check: the compiler's argument bytes {format_bytes(m.compiler_arguments)}; "
      f"exact params + optimizer + batch {format_bytes(exact_args)}",
  ]
  if m.backend != m.platform:
    lines += [
        "  note: temporaries (activations, gradients, gathered weights) are XLA:CPU's buffer",
        "  assignment for this program: an ESTIMATE for accelerators, not a measurement of one.",
        "  GPU/TPU compilers fuse and schedule differently, and XLA:CPU computes bfloat16",
        "  matmuls in float32 (their transient buffers are larger than on an accelerator).",
    ]
  lines += _peak_lines(m)
  analytic = aot.analytic_flops_per_step(config)
  n = m.num_devices
  xla = ("not reported by this compiler" if m.xla_flops != m.xla_flops  # NaN: GPU deviceless
         else f"{m.xla_flops * n:.3e}  counts each loop body once (layers, microbatches, loss "
              f"chunks)")
  lines += [
      "", f"FLOPs per step (all {n} devices):",
      f"  compiled program  {m.flops * n:.3e}  matmuls of the optimized HLO, loop bodies × "
      f"trip counts",
      f"  XLA cost_analysis {xla}",
      f"  analytic          {analytic:.3e}  (6·N_matmul + 6·L·T·H·E) per token × "
      f"{aot.analytic_tokens_per_step(config):,} tokens"
      + objectives.get(config).flops_note(),
      f"  compiled / analytic {m.flops * n / analytic:.2f}: remat recompute"
      + ("; attention kernels' matmuls are not HLO dots"
         if config.mesh.context > 1 and "Pallas kernels" in m.attention_note and
         m.backend != "cpu" else
         "; context-parallel attention tiles counted as if none were skipped"
         if config.mesh.context > 1 else
         "; blockwise attention computes masked blocks too" if cfg.runtime.attention_impl ==
         "blockwise" else "; attention kernels' matmuls are not HLO dots"
         if cfg.runtime.attention_impl in ("pallas", "cudnn", "auto") and m.backend != "cpu"
         else "; attention computed for all T×S pairs (masked too)"),
  ]
  if m.loops_without_trip_count:
    lines.append(f"  ({m.loops_without_trip_count} loop(s) without a known trip count were "
                 f"counted once)")
  return lines + interconnect.section(m, target)
