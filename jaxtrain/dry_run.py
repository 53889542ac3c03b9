"""`--dry_run`: will this config fit, on how many chips of which kind? Answered from a laptop.

`python -m jaxtrain.main --config=configs/llama70b.py --dry_run --dry_run_devices=64` compiles the
real train step for a mesh of 64 devices (emulated CPU devices: this command re-runs itself in a
subprocess with `--xla_force_host_platform_device_count=64` when it has fewer) on abstract inputs,
then prints per-device memory, FLOPs per step, the parameter shardings, a verdict per accelerator
(accelerators.py) and, where it does not fit, changes that make it fit, each measured by compiling
it too where a compile is needed (fit_options.py). The last line is for scripts:

  dry_run: devices=N params_gib=X opt_gib=X temp_gib=X total_gib=X

(opt_gib: optimizer state in device memory; total_gib: all device memory per device.)
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

from jaxtrain import accelerators, aot, fit_options, metrics
from jaxtrain.accelerators import GIB
from jaxtrain.config import ConfigError
from jaxtrain.config_checks import validate

_CHILD_ENV = "JAXTRAIN_DRY_RUN_CHILD"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass
class Result:
  base: aot.Measurement
  verdicts: list[accelerators.Verdict]
  options: list[fit_options.Option]
  last_line: str


def main(config, num_devices: int | None, config_name: str = "") -> int:
  """CLI entry (main.py --dry_run). Returns the exit code; ConfigError propagates."""
  import jax  # pylint: disable=import-outside-toplevel  (after main.py set up the process)
  if num_devices is not None and num_devices < 1:
    raise ConfigError(f"--dry_run_devices={num_devices}: must be a positive device count")
  devices = jax.devices()
  n = num_devices or len(devices)
  validate(config, n, "gpu" if devices[0].platform == "cpu" else devices[0].platform)
  if n > len(devices):
    if os.environ.get(_CHILD_ENV):
      raise RuntimeError(f"asked for {n} emulated CPU devices, got {len(devices)}")
    return _rerun_with_cpu_devices(n)
  run(config, devices[:n], config_name)
  return 0


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


def run(config, devices, config_name: str = "", out=None,
        table: tuple[accelerators.Accelerator, ...] = accelerators.ACCELERATORS) -> Result:
  """Measures `config` on `devices`, prints the report through `out`, returns the figures."""
  out = out or (lambda line: print(line, flush=True))
  start = time.perf_counter()
  base = aot.measure(config, devices)
  verdicts = [accelerators.verdict(a, base.total) for a in table]
  for line in _describe(config, base, config_name):
    out(line)
  out("")
  out(f"verdict: {_gib(base.total)} per device needed; 'fits' leaves "
      f"{100 - 100 * accelerators.USABLE_FRACTION:.0f}% of the memory to the runtime")
  for v in verdicts:
    out(f"  {v.accelerator.name:<12} {v.accelerator.memory_gib:>5.0f} GiB  {v.status:<13} "
        f"headroom {_gib(v.headroom_gib * GIB, signed=True)}")
  options: list[fit_options.Option] = []
  if not all(v.fits for v in verdicts):
    out("")
    out("suggestions: changes that make it fit, with their per-device totals ('compiled': "
        "measured")
    out("like the above; 'exact': arithmetic on exact bytes; 'estimate': as described)")
    options = fit_options.options(config, devices, base, table)
    for line in fit_options.describe(options, base, verdicts, table):
      out(line)
  last = (f"dry_run: devices={len(devices)} params_gib={_number(base.params / GIB)} "
          f"opt_gib={_number(base.opt_device / GIB)} temp_gib={_number(base.temp / GIB)} "
          f"total_gib={_number(base.total / GIB)}")
  out("")
  out(f"dry run took {time.perf_counter() - start:.1f} s")
  out(last)
  return Result(base, verdicts, options, last)


def _gib(n: float, signed: bool = False) -> str:
  return accelerators.format_bytes(n, signed)


def _number(x: float) -> str:
  """Four decimals for GiB-sized figures, six significant digits for tiny test models."""
  return f"{x:.4f}" if x >= 0.1 else f"{x:.6g}"


def _describe(config, m: aot.Measurement, config_name: str) -> list[str]:
  """The run table, parameter shardings, memory and FLOPs of the base measurement."""
  cfg, t, o = m.model_cfg, config.train, config.optim
  shards = m.mesh.batch_shards
  microbatch = t.global_batch_size // (shards * t.grad_accum_steps)
  where = (f"{m.num_devices} emulated CPU devices (XLA:CPU), modelling an accelerator"
           if m.backend == "cpu" else f"{m.num_devices} {m.backend} devices")
  rows = [
      ("config", config_name or "(from flags)"),
      ("compiled for", where),
      ("parameters", f"{metrics.format_count(metrics.count_params(cfg))} "
                     f"({metrics.count_params(cfg):,}); L={cfg.num_layers} D={cfg.d_model} "
                     f"H={cfg.num_heads} K={cfg.num_kv_heads} E={cfg.head_dim} "
                     f"F={cfg.mlp_dim} V={cfg.vocab_size}"),
      ("mesh", f"data={m.mesh.data} fsdp={m.mesh.fsdp} tensor={m.mesh.tensor}"),
      ("batch", f"global {t.global_batch_size} seq × {t.seq_len}; per device "
                f"{t.global_batch_size // shards} seq, microbatch {microbatch} "
                f"(grad accum {t.grad_accum_steps})"),
      ("dtypes", f"params {cfg.param_dtype}, compute {cfg.dtype}, Adam moments "
                 f"{o.state_dtype} in {'pinned host' if o.offload_state else 'device'} "
                 f"memory"),
      ("remat", cfg.remat_policy + (f" ({m.remat_note})" if m.remat_note else "")),
      ("attention", m.attention_note),
      ("compile", f"{m.compile_s:.1f} s"),
  ]
  lines = [metrics.format_table(rows, title="jaxtrain dry run"), "",
           "parameter shardings (PartitionSpec over mesh axes; per-device bytes):"]
  width = max(len(p.path) for p in m.param_shards)
  for p in m.param_shards:
    shape = "[" + ", ".join(str(d) for d in p.shape) + "]"
    lines.append(f"  {p.path:<{width}}  {shape:<22} {p.dtype:<8} {p.spec:<34} "
                 f"{_gib(p.device_bytes):>10}")
  exact_args = m.params + m.opt_device + m.opt_host + m.batch
  host = m.opt_host + m.act_host
  lines += [
      "", "per-device memory:",
      f"  parameters       {_gib(m.params):>11}  exact, from the shardings"
      + (f" (trained {_gib(m.params - m.frozen)}, frozen {_gib(m.frozen)})" if m.frozen
         else ""),
      f"  optimizer state  {_gib(m.opt_device):>11}  exact (device memory)",
      f"  batch            {_gib(m.batch):>11}  exact",
      f"  temporaries      {_gib(m.temp):>11}  from the compiler (see the note)",
      f"  new outputs      {_gib(m.outputs):>11}  outputs not written over the donated state",
      f"  total            {_gib(m.total):>11}  device memory needed",
      f"  host (pinned)    {_gib(host):>11}  optimizer state {_gib(m.opt_host)}, offloaded "
      f"activations {_gib(m.act_host)}",
      f"  cross-check: the compiler's argument bytes {_gib(m.compiler_arguments)}; exact "
      f"params + optimizer + batch {_gib(exact_args)}",
  ]
  if m.backend == "cpu":
    lines += [
        "  note: temporaries (activations, gradients, gathered weights) are XLA:CPU's buffer",
        "  assignment for this program: an ESTIMATE for accelerators, not a measurement of one.",
        "  GPU/TPU compilers fuse and schedule differently, and XLA:CPU computes bfloat16",
        "  matmuls in float32 (their transient buffers are larger than on an accelerator).",
    ]
  analytic = aot.analytic_flops_per_step(config)
  n = m.num_devices
  lines += [
      "", f"FLOPs per step (all {n} devices):",
      f"  compiled program  {m.flops * n:.3e}  matmuls of the optimized HLO, loop bodies × "
      f"trip counts",
      f"  XLA cost_analysis {m.xla_flops * n:.3e}  counts each loop body once (layers, "
      f"microbatches, loss chunks)",
      f"  analytic          {analytic:.3e}  (6·N_matmul + 6·L·T·H·E) per token × "
      f"{aot.analytic_tokens_per_step(config):,} tokens"
      + (" × 4/3 (DPO: the reference's forward)" if t.objective == "dpo" else ""),
      f"  compiled / analytic {m.flops * n / analytic:.2f}: remat recompute"
      + ("; blockwise attention computes masked blocks too" if cfg.attention_impl ==
         "blockwise" else "; attention computed for all T×S pairs (masked too)"),
  ]
  if m.loops_without_trip_count:
    lines.append(f"  ({m.loops_without_trip_count} loop(s) without a known trip count were "
                 f"counted once)")
  return lines
