"""Before the first weight is allocated: will the train step fit these devices' memory?

The trainer compiles its step anyway; `check` compiles it first, on abstract inputs, and compares
what one device needs (exact state bytes, the compiler's temporaries and outputs) with what one
device has: the runtime's `bytes_limit` on GPU and TPU, this host's available memory shared by its
CPU devices. A step that cannot fit stops the run with one line (needed and available GiB per
device, the best change, the dry-run command that shows every option) and exit code 2, before
anything is allocated or written. The state alone is checked before compiling, so a model far too
large for the host says so at once.

The compiled step is returned, and the trainer runs it: the check costs no second compile.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from jaxtrain.hardware import GIB, USABLE_FRACTION, host_available_bytes
from jaxtrain.parallel.mesh import BATCH_AXES
from jaxtrain.train import measure
from jaxtrain.train import setup as train_setup
from jaxtrain.train.setup import Setup


class DoesNotFitError(ValueError):
  """The step needs more memory per device than the devices have (one line, with a fix)."""


@dataclasses.dataclass(frozen=True)
class Memory:
  available: int  # bytes per device
  where: str  # for the message: "80.0 GiB H100 device", ...


def available_memory(devices) -> Memory:
  """Bytes one device can give the step: its allocator's limit, or this host's free memory
  shared by its CPU devices."""
  device = devices[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
      return Memory(int(stats["bytes_limit"]), f"{device.device_kind} device")
  local = [d for d in devices if d.process_index == jax.process_index()] or devices
  return Memory(host_available_bytes() // len(local),
                f"CPU device ({len(local)} sharing this host's available memory)")


def check(config, setup: Setup, config_path: str = ""):
  """The compiled train step of `setup`, if it fits the mesh's devices; DoesNotFitError if not."""
  devices = list(setup.mesh.devices.flat)
  memory = available_memory(devices)
  state = train_setup.abstract_state(setup, config.train.seed)
  exact = measure.state_bytes(state)
  refuse = functools.partial(_refuse, config, config_path, memory, exact, setup.mesh)
  if exact.on_device > memory.available:
    raise refuse(exact.on_device, compiled=False)
  try:
    compiled, _, batch = measure.compile_setup(setup, config, state=state)
  except measure.CompilerOutOfMemory as e:  # libtpu refuses what cannot fit its HBM
    raise refuse(exact.on_device + measure.batch_bytes(e.batch) + e.temp, compiled=True) from None
  temp, outputs = measure.compiled_bytes(compiled)
  needed = exact.on_device + measure.batch_bytes(batch) + temp + outputs
  if needed > memory.available:
    raise refuse(needed, compiled=True)
  return compiled


def _refuse(config, config_path: str, memory: Memory, exact: measure.StateBytes, mesh,
            needed: int, *, compiled: bool) -> DoesNotFitError:
  what = ("the train step needs" if compiled else
          "the parameters and optimizer state alone need")
  fix = best_change(config, exact, needed, memory.available, mesh)
  command = (f"python -m jaxtrain.main --config={config_path or 'CONFIG'} --dry_run "
             f"--dry_run_target={config.target}")
  return DoesNotFitError(
      f"{what} {needed / GIB:.2f} GiB per device, {memory.available / GIB:.2f} GiB available "
      f"per {memory.where}; {fix}; every option, measured for the config's target: {command}")


def best_change(config, exact: measure.StateBytes, needed: int, available: int, mesh) -> str:
  """The cheapest change known without another compile (exact bytes), in words."""
  devices = list(mesh.devices.flat)
  usable = available * USABLE_FRACTION
  o, t = config.optim, config.train
  if o.state_dtype == "float32" and not o.offload_state and needed - exact.opt_device / 2 <= usable:
    return "try --config.optim.state_dtype=bfloat16 (Adam moments in half the bytes)"
  if devices[0].platform != "cpu" and not o.offload_state and needed - exact.opt_device <= usable:
    return "try --config.optim.offload_state=True (optimizer state in host memory)"
  activations = needed - exact.on_device
  batch_shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
  microbatch = t.global_batch_size // (batch_shards * t.grad_accum_steps)
  room = usable - exact.on_device
  if room > 0 and activations > 0 and microbatch > 1:
    # Activations scale about linearly with the microbatch: split it k ways.
    k = min(microbatch, 2 ** math.ceil(math.log2(activations / room)))
    while microbatch % k:
      k *= 2
    return (f"try --config.train.grad_accum_steps={k * t.grad_accum_steps} (microbatch "
            f"{microbatch} -> {microbatch // k} per device; activations scale about with it)")
  room = usable - activations
  if room > 0:  # fsdp over k times the devices divides the state by k; activations stay
    factor = 2 ** math.ceil(math.log2(max(1.0, exact.on_device / room)))
    return (f"it needs about {factor}x the devices ({factor * len(devices)}) to shard the "
            f"{exact.on_device / GIB:.1f} GiB of state per device, or a config sized for this "
            f"machine (e.g. configs/tiny.py)")
  return ("activations alone exceed the memory: use --config.model.remat_policy=full, or "
          "shorten train.seq_len")
