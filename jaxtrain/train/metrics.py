"""Parameter and FLOP accounting, peak FLOP/s per device, MFU, and the run's metric writers.

Parameters and FLOPs per token come from the model (jaxtrain/models/cost.py: one definition for
every family, from its architecture); the functions here take an Architecture
(`ModelConfig.arch`, or `models.config.architecture_of(config)`).

MFU = tokens_per_sec * flops_per_token / (peak FLOP/s per device * number of devices). The peak
comes from the accelerator table's dense bf16 figures (jaxtrain/hardware.py); on CPU it is
measured (see `measure_cpu_matmul_peak`). Unknown accelerators get no peak, and MFU is reported as
n/a rather than a number computed against a guessed peak.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import os
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jaxtrain import hardware as targets
from jaxtrain.models import cost

# Size of the square float32 matmul used to measure a CPU host: big enough that dispatch overhead
# is negligible and XLA spreads it over all cores, small enough to time in tens of milliseconds.
_CPU_MATMUL_N = 1024
_CPU_MEASURE_BUDGET_S = 1.0


# --------------------------------------------------------------------------------------------
# Parameter and FLOP counts.
# --------------------------------------------------------------------------------------------


def count_params(arch, active: bool = False) -> int:
  """Parameters of the model `arch` (an Architecture); Llama 3.1 8B gives 8,030,261,248.
  `active`: those one token uses (an MoE model's k experts per MoE layer, not all of them)."""
  return cost.param_count(arch, active)


def moe_row(model_cfg, expert_shards: int) -> tuple[str, str] | None:
  """The run table's `moe` row (experts, top-k, total and active parameters, dispatch), or
  None for a dense model."""
  a = model_cfg.arch
  if not a.num_experts:
    return None
  total, active = count_params(a), count_params(a, active=True)
  cf = model_cfg.runtime.moe_capacity_factor
  dispatch = f"capacity factor {cf:g}" if cf > 0 else "dropless"
  where = (f"; experts split over {expert_shards} devices (mesh.expert)" if expert_shards > 1
           else "")
  return ("moe", f"{a.num_experts} experts (F={a.expert_dim}), top {a.experts_per_token} on "
                 f"{sum(a.moe_layers())} of {a.num_layers} layers{_deepseek_routing(model_cfg)}"
                 f"; parameters {format_count(total)} total, {format_count(active)} active "
                 f"({100 * active / total:.1f}%); {dispatch}{where}")


def _deepseek_routing(model_cfg) -> str:
  """DeepSeek's router in words (sigmoid scores, groups, scale, shared experts, balancing)."""
  a, rt = model_cfg.arch, model_cfg.runtime
  parts = []
  if a.router_score == "sigmoid":
    parts.append("sigmoid scores")
  if a.n_group > 1:
    parts.append(f"within the best {a.topk_group} of {a.n_group} groups")
  if a.routed_scaling_factor != 1.0:
    parts.append(f"weights x{a.routed_scaling_factor:g}")
  if a.num_shared_experts:
    parts.append(f"{a.num_shared_experts} shared")
  if a.router_bias:
    rate = rt.moe_bias_update_rate if model_cfg.peft.lora_rank == 0 else 0.0
    parts.append(f"bias balancing at {rate:g}" if rate > 0 else "router biases fixed")
  if rt.moe_seq_aux_loss_coef > 0:
    parts.append(f"sequence balance loss x{rt.moe_seq_aux_loss_coef:g}")
  return f" ({', '.join(parts)})" if parts else ""


def flops_per_token(arch, seq_len: int) -> float:
  """Training (forward + backward) FLOPs per token; see jaxtrain/models/cost.py."""
  return cost.flops_per_token(arch, seq_len)


def flops_per_step(arch, seq_len: int, global_batch_size: int) -> float:
  """Training FLOPs per optimizer step: flops_per_token * seq_len * global_batch_size."""
  return flops_per_token(arch, seq_len) * int(seq_len) * int(global_batch_size)


# --------------------------------------------------------------------------------------------
# Peak FLOP/s and MFU.
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def measure_cpu_matmul_peak(n: int = _CPU_MATMUL_N, budget_s: float = _CPU_MEASURE_BUDGET_S
                            ) -> float:
  """Measures the host's float32 matmul throughput in FLOP/s (best of several timed runs).

  XLA:CPU runs one dot on the host's shared intra-op thread pool, i.e. on all cores, so a matmul
  on a single CPU device measures the whole host. Cached: the first call costs up to ~budget_s
  plus one compile, later calls are free.
  """
  import jax  # Local import: the rest of this module (counts, writers) must not need jax.
  import jax.numpy as jnp

  device = jax.local_devices(backend="cpu")[0]
  a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
  b = jax.device_put(jnp.full((n, n), 0.5, jnp.float32), device)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()  # Compile and warm up caches/threads; not timed.
  best = math.inf
  start = time.perf_counter()
  # At least 3 timed reps so one preempted run cannot set the figure; stop at the time budget
  # (the host may be slow or shared) or after 20 reps (more add nothing to a best-of).
  for rep in range(20):
    t0 = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
    if rep >= 2 and time.perf_counter() - start > budget_s:
      break
  return 2.0 * n ** 3 / best


def _lookup_peak(device_kind: str, precision: str) -> Optional[tuple[float, str]]:
  found = targets.chip_for_device_kind(device_kind, precision)
  if found is None or not found[1]:
    return None
  name, peak = found
  kind = "fp8" if precision in ("fp8", "mxfp8") else "bf16"
  return peak, f"{name} dense {kind} peak (table), device_kind {device_kind!r}"


def peak_flops_per_device(device, precision: str = "none") -> tuple[Optional[float], str]:
  """Peak FLOP/s of one device and where the figure comes from.

  Accelerators: looked up in the accelerator table (jaxtrain/hardware.py) by
  `device.device_kind`. CPU: the measured host
  matmul throughput divided by the number of local CPU devices -- emulated CPU devices
  (`jax_num_cpu_devices`) all share the same cores, so each gets that share, and per-device peak
  times device count is the host's peak. Unknown accelerators: (None, reason), so that MFU is
  shown as n/a instead of a wrong number. `precision` (precision.matmul): "fp8" and "mxfp8"
  take the chip's FP8 peak, so MFU is against the peak of the precision in use.
  """
  if device.platform == "cpu":
    import jax
    num_cpu = len(jax.local_devices(backend="cpu"))
    host = measure_cpu_matmul_peak()
    return host / num_cpu, (f"measured: f32 {_CPU_MATMUL_N}² matmul, host shared by {num_cpu} "
                            f"CPU device(s)")
  found = _lookup_peak(str(device.device_kind), precision)
  if found is None:
    return None, (f"unknown device kind {device.device_kind!r} (platform {device.platform}); "
                  f"no peak FLOP/s known, MFU not reported")
  return found


def peak_flops_for_devices(devices: Sequence[Any], precision: str = "none"
                           ) -> tuple[Optional[float], str]:
  """Summed peak FLOP/s over `devices` (assumed homogeneous; the first one is looked up) for
  precision.matmul=`precision`."""
  if not devices:
    return None, "no devices"
  per_device, source = peak_flops_per_device(devices[0], precision)
  if per_device is None:
    return None, source
  return per_device * len(devices), source


# The parameter `flops_per_token` shadows the function of that name; it is the public keyword.
def mfu(tokens_per_sec: float, flops_per_token: float,  # pylint: disable=redefined-outer-name
        peak_flops_total: Optional[float]) -> Optional[float]:
  """Model FLOPs utilisation as a fraction in [0, 1]; None when the peak is unknown."""
  if peak_flops_total is None or peak_flops_total <= 0:
    return None
  return float(tokens_per_sec) * float(flops_per_token) / float(peak_flops_total)


# --------------------------------------------------------------------------------------------
# Formatting.
# --------------------------------------------------------------------------------------------


def format_count(x: float, precision: int = 3) -> str:
  """Short human form of a count: 512, 41.2k, 8.03B, 1.2T (k/M/B/T, `precision` significant)."""
  if x is None or not math.isfinite(x):
    return str(x)
  for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.{precision}g}{suffix}"
  return f"{x:.{precision}g}"


def format_duration(seconds: float) -> str:
  """1h02m, 1m52s, 7s."""
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


def format_table(rows: Sequence[tuple[str, str]], title: str = "jaxtrain run") -> str:
  """Renders (name, value) rows as two aligned columns under a title line and a rule."""
  rows = [(str(k), str(v)) for k, v in rows]
  key_width = max((len(k) for k, _ in rows), default=0)
  lines = [f"{k:<{key_width}}  {v}" for k, v in rows]
  width = max([len(title)] + [len(line) for line in lines])
  return "\n".join([title, "-" * width] + lines)


# --------------------------------------------------------------------------------------------
# Metric writers.
# --------------------------------------------------------------------------------------------


def _to_json_value(value: Any) -> Any:
  """Plain Python value for JSON: numpy/jax scalars become int/float, non-finite floats None.

  Non-finite floats become null because JSON has no NaN/Infinity (json.dumps would otherwise emit
  bare `NaN`, which strict parsers reject); a null loss in the log marks a diverged step.
  """
  if value is None or isinstance(value, (str, bool)):
    return value
  if isinstance(value, np.bool_):
    return bool(value)
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    value = float(value)
    return value if math.isfinite(value) else None
  if hasattr(value, "__array__"):  # numpy / jax arrays; fetches a device value to the host.
    array = np.asarray(value)
    if array.size == 1:
      return _to_json_value(array.reshape(()).item())
    return [_to_json_value(v) for v in array.reshape(-1).tolist()]
  if isinstance(value, Mapping):
    return {str(k): _to_json_value(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_to_json_value(v) for v in value]
  return str(value)


def _float_or_none(value: Any) -> Optional[float]:
  """A float for console/TensorBoard (NaN kept), or None for missing/non-numeric values."""
  if value is None or isinstance(value, (str, bool)):
    return None
  try:
    return float(np.asarray(value).reshape(()))
  except (TypeError, ValueError):
    return None


# How long, and how large, one TensorBoard event file grows before the next is started.
TENSORBOARD_ROTATE_S = 300.0
TENSORBOARD_ROTATE_BYTES = 4 * 2**20


class MetricsWriter:
  """Writes training/eval metrics to metrics.jsonl, TensorBoard, W&B and a console progress line.

  WORKDIR/metrics.jsonl gets one JSON object per call, flushed immediately so a crashed run keeps
  every record written before the crash. The file is appended to, so a resumed run continues the
  same log. Non-finite floats are written as null (see `_to_json_value`). Training records are
  {"step", "loss", "learning_rate", "grad_norm", "tokens_per_sec", "mfu", ...extra keys}; eval
  records are {"step", "eval_loss", ...extra keys}. `mfu` is a fraction (0.123 = 12.3%).

  `wandb` (a jaxtrain.train.wandb.WandbLogger, or None) gets every scalar TensorBoard gets, with
  the same name and step, and is closed with the writer.

  TensorBoard's event file is closed and a new one started every `tensorboard_rotate_s` seconds
  or `tensorboard_rotate_bytes` bytes, whichever comes first (TensorBoard reads every event file
  of the directory, in the order of their names): a bucket workdir uploads each closed file once
  (jaxtrain/checkpointing/run_directory.py), where an object store can only rewrite a growing one
  whole.

  In a multi-host run create it on process 0 only.
  """

  _TRAIN_KEYS = ("loss", "learning_rate", "grad_norm", "tokens_per_sec", "mfu")

  def __init__(self, workdir: str, *, tensorboard: bool = True, total_steps: Optional[int] = None,
               print_fn=None, wandb=None, tensorboard_rotate_s: float = TENSORBOARD_ROTATE_S,
               tensorboard_rotate_bytes: int = TENSORBOARD_ROTATE_BYTES):
    self.workdir = os.fspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    self.total_steps = total_steps
    self._print = print_fn or functools.partial(print, flush=True)
    self._jsonl = open(os.path.join(self.workdir, "metrics.jsonl"), "a", encoding="utf-8")
    self._tb = None
    self._tb_dir = os.path.join(self.workdir, "tensorboard")
    self._tb_rotate = (tensorboard_rotate_s, tensorboard_rotate_bytes)
    self._tb_files = 0  # event files this writer opened
    if tensorboard:
      self._open_event_file()
    self._wandb = wandb
    # (wall time, step) at the first write_train call. The rate for the ETA is measured from
    # there, so the first logged interval -- which contains compilation -- never enters it.
    self._anchor: Optional[tuple[float, int]] = None

  # -- records --------------------------------------------------------------------------------

  def _write_json(self, record: Mapping[str, Any]):
    clean = {str(k): _to_json_value(v) for k, v in record.items()}
    self._jsonl.write(json.dumps(clean, allow_nan=False) + "\n")
    self._jsonl.flush()

  def _write_scalars(self, prefix: str, step: int, scalars: Mapping[str, Any]):
    """TensorBoard and W&B: `prefix/name` for every numeric value (NaN kept, None dropped)."""
    values = {f"{prefix}/{name}": _float_or_none(value) for name, value in scalars.items()}
    values = {name: value for name, value in values.items() if value is not None}
    if self._tb is not None:
      for name, value in values.items():
        self._tb.add_scalar(name, value, global_step=step)
      self._tb.flush()
      self._rotate_event_file()
    if self._wandb is not None:
      self._wandb.log(step, values)

  def _open_event_file(self):
    from tensorboardX import SummaryWriter  # Local import: optional for jsonl-only users.
    before = set(os.listdir(self._tb_dir)) if os.path.isdir(self._tb_dir) else set()
    # The file's name holds the second it was opened; the suffix keeps two files opened in one
    # second apart, in order.
    self._tb = SummaryWriter(logdir=self._tb_dir, filename_suffix=(
        f".{self._tb_files:05d}" if self._tb_files else ""))
    self._tb_files += 1
    opened = sorted(set(os.listdir(self._tb_dir)) - before)
    self._tb_path = os.path.join(self._tb_dir, opened[-1]) if opened else None
    self._tb_opened = time.monotonic()

  def _rotate_event_file(self):
    """A new event file once this one is `tensorboard_rotate_s` old or `..._bytes` large."""
    seconds, size = self._tb_rotate
    if (time.monotonic() - self._tb_opened >= seconds or
        (self._tb_path and os.path.exists(self._tb_path) and
         os.path.getsize(self._tb_path) >= size)):
      self._tb.close()  # every event queued so far is in the file once this returns
      self._open_event_file()

  def write_train(self, step: int, metrics: Mapping[str, Any]):
    """Logs one training step: jsonl record, `train/<key>` scalars, console line."""
    step = int(step)
    ordered = {k: metrics[k] for k in self._TRAIN_KEYS if k in metrics}
    ordered.update({k: v for k, v in metrics.items() if k not in ordered})
    self._write_json({"step": step, **ordered})
    self._write_scalars("train", step, ordered)
    self._print(self._progress_line(step, ordered))

  def write_eval(self, step: int, eval_loss: Any, **extra: Any):
    """Logs one evaluation: jsonl {"step", "eval_loss", **extra}, scalars `eval/loss` and
    `eval/<key>`."""
    step = int(step)
    self._write_json({"step": step, "eval_loss": eval_loss, **extra})
    self._write_scalars("eval", step, {"loss": eval_loss, **extra})
    parts = [f"eval step {step}", f"eval_loss {_fmt(eval_loss, '.4f')}"]
    parts += [f"{k} {_fmt(v, '.4g')}" for k, v in extra.items()]
    self._print(" | ".join(parts))

  # -- console --------------------------------------------------------------------------------

  def _eta(self, step: int) -> Optional[float]:
    now = time.perf_counter()
    if self._anchor is None:
      self._anchor = (now, step)
      return None
    t0, s0 = self._anchor
    if not self.total_steps or step <= s0 or now <= t0:
      return None
    seconds_per_step = (now - t0) / (step - s0)
    return max(0, self.total_steps - step) * seconds_per_step

  def _progress_line(self, step: int, m: Mapping[str, Any]) -> str:
    if self.total_steps:
      width = len(str(self.total_steps))
      parts = [f"step {step:>{width}}/{self.total_steps}"]
    else:
      parts = [f"step {step}"]
    if "loss" in m:
      parts.append(f"loss {_fmt(m['loss'], '.4f')}")
    if "learning_rate" in m:
      parts.append(f"lr {_fmt(m['learning_rate'], '.2e')}")
    if "grad_norm" in m:
      parts.append(f"gnorm {_fmt(m['grad_norm'], '.3g')}")
    if "reward_accuracy" in m:  # DPO
      parts.append(f"reward acc {_fmt(m['reward_accuracy'], '.2f')}")
    if "reward_mean" in m:  # GRPO
      parts.append(f"reward {_fmt(m['reward_mean'], '.3f')}")
    if "moe_aux_loss" in m:  # MoE: the router's balance (1 = even) and its busiest expert
      parts.append(f"aux {_fmt(m['moe_aux_loss'], '.3f')} max load "
                   f"{_fmt(m['moe_max_load'], '.2f')}")
    if "mtp_loss" in m:  # multi-token prediction: the modules' mean loss (not in `loss` alone)
      parts.append(f"mtp {_fmt(m['mtp_loss'], '.4f')}")
    if "moe_dropped_fraction" in m:
      dropped = _float_or_none(m["moe_dropped_fraction"])
      parts.append("dropped n/a" if dropped is None else f"dropped {100 * dropped:.1f}%")
    if "tokens_per_sec" in m:
      tps = _float_or_none(m["tokens_per_sec"])
      parts.append(f"{format_count(tps) if tps is not None else 'n/a'} tok/s")
    if "mfu" in m:
      value = _float_or_none(m["mfu"])
      parts.append("MFU n/a" if value is None or not math.isfinite(value)
                   else f"MFU {100 * value:.1f}%")
    eta = self._eta(step)
    if eta is not None:
      parts.append(f"ETA {format_duration(eta)}")
    return " | ".join(parts)

  # -- lifecycle ------------------------------------------------------------------------------

  def flush(self):
    self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self):
    if not self._jsonl.closed:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb is not None:
      self._wandb.close()
      self._wandb = None

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc_info):
    self.close()


def _fmt(value: Any, spec: str) -> str:
  number = _float_or_none(value)
  if number is None:
    return "n/a"
  return format(number, spec)
