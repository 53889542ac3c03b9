"""Ahead-of-time compile of the real train step on abstract inputs: per-device memory and FLOPs.

The step is built by the trainer's own `build` (abstract model -> shardings -> optimizer ->
`make_train_step` -> `jit_train_step`, with its in/out shardings and donated state), then lowered
with `jax.ShapeDtypeStruct` inputs that carry those shardings, so no weight is ever allocated.
Parameter and optimizer bytes per device are exact (shard shapes times itemsizes); temporaries
and outputs come from the compiler's `memory_analysis()`, except TPU temporaries, which are read
from libtpu's buffer assignment (memory_breakdown.py says why); FLOPs from the optimized HLO
(`hlo_flops`) and from XLA's own `cost_analysis()`.

The devices decide the compiler: a deviceless target's (targets.devices: XLA's GPU compiler,
or libtpu's) gives that compiler's exact figures, kernels included. Compiling on CPU devices
for an accelerator (`platform` "gpu" or "tpu": `--dry_run_devices`, or a target whose compiler is
not installed) models it: `model.dtype="auto"` resolves as on the accelerator (bfloat16), and a
fused attention kernel (cuDNN, Pallas), which XLA:CPU cannot compile, is stood in for by
`blockwise_attention`, which has the same memory profile; the figures are then an estimate.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import objectives
from jaxtrain.train import setup as train_setup
from jaxtrain.ops.attention import CUDNN_MAX_HEAD_DIM, context_kernel_platform, impl_that_runs
from jaxtrain.models.config import ModelConfig
from jaxtrain.parallel.mesh import MeshShape, make_mesh, platform_of_backend
from jaxtrain.train import hlo_flops
from jaxtrain.train import memory_breakdown as breakdown_lib
from jaxtrain.train import optim
from jaxtrain.train.step import opt_state_shardings
from jaxtrain.validation.checks import validate

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")
# A dry run never executes its CPU program, so LLVM need not optimize it: these leave the HLO,
# and so buffer assignment and FLOPs, unchanged and halve XLA:CPU compile time.
_CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_allow_excess_precision": False,
                        "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass
class ParamShard:
  """One parameter array: where it is split and what each device holds."""
  path: str
  shape: tuple[int, ...]
  dtype: str
  spec: str
  device_bytes: int


@dataclasses.dataclass
class Measurement:
  """Per-device figures of one compiled train step (bytes unless named otherwise)."""
  num_devices: int
  backend: str  # the compiler that compiled it: "cpu", "gpu" or "tpu"
  platform: str  # what the run is for; differs from `backend` when XLA:CPU models a GPU/TPU
  mesh: MeshShape
  model_cfg: ModelConfig
  params: int  # exact, from the shardings
  opt_device: int  # optimizer state in device memory
  opt_host: int  # optimizer state in host memory (optim.offload_state)
  batch: int
  temp: int  # compiler: temporaries (activations, gradients, gathered weights, ...)
  outputs: int  # compiler: outputs not written in place of donated inputs
  compiler_arguments: int  # compiler: all argument bytes, to cross-check the exact figures
  flops: float  # per device, compiled matmuls with loops counted per iteration
  xla_flops: float  # per device, compiled.cost_analysis() (each loop body once)
  loops_without_trip_count: int
  compile_s: float
  param_shards: list[ParamShard]
  attention_note: str
  act_host: int = 0  # saved activations in host memory (offload remat policies), estimated
  remat_note: str = ""
  # Set when the optimizer state's host placement could not be compiled (a deviceless GPU
  # target): what the figures assume instead.
  offload_note: str = ""
  # Of `params`: weights that do not train (the LoRA/QLoRA base, the DPO reference), exact.
  frozen: int = 0
  # Weights kept beside the train state (GRPO's reward models), exact; in `total`.
  resident: int = 0
  # The buffers live at the memory peak (memory_breakdown.py), when asked for; and the compiler's
  # memory_analysis() temporaries where `temp` comes from the buffer assignment instead.
  breakdown: breakdown_lib.Breakdown | None = None
  reported_temp: int | None = None
  hlo: str = ""  # the compiled step's optimized HLO text, which the FLOP count reads
  # optim.name=muon: what AdamW's state (two moments for every weight) would take, exact.
  adamw_opt: int = 0

  @property
  def total(self) -> int:
    """Device memory the step needs per device: live state, batch, temporaries, new outputs."""
    return self.params + self.opt_device + self.batch + self.temp + self.outputs + self.resident


def _nbytes(shape, dtype) -> int:
  return int(math.prod(shape)) * jnp.dtype(dtype).itemsize


def _shard_bytes(abstract, sharding) -> int:
  return _nbytes(sharding.shard_shape(abstract.shape), abstract.dtype)


def modelled_model_config(config, backend: str, platform: str) -> tuple[ModelConfig, str]:
  """The model config `platform` would run, adapted to compile on `backend`; and a note on how
  attention is compiled or modelled."""
  cfg = ModelConfig.from_config(config, platform=platform)
  impl = config.attention.impl
  resolved = impl_that_runs(impl, platform, cfg.arch.head_dim, config.mesh.stage)
  shown = f"{impl!r}" + (f" ({resolved})" if impl in ("auto", "cudnn") and impl != resolved
                         else "")
  if platform == "gpu" and impl == "auto" and resolved == "pallas":
    shown += f": cuDNN takes head dims up to {CUDNN_MAX_HEAD_DIM}, not {cfg.arch.head_dim}"
  if config.mesh.context > 1:
    # Context parallelism runs its own attention (jaxtrain.parallel.context_attention).
    how = (f"context parallel over {config.mesh.context} devices "
           f"({config.attention.context_parallel}, "
           f"{'load-balanced' if config.attention.load_balance else 'contiguous'})")
    kernels = context_kernel_platform(resolved, platform, config.attention.interpret)
    if backend == "cpu" and platform != "cpu":
      note = (f"{how}: " + ("our Pallas kernels per chunk pair on GPU, " if kernels else "")
              + "modelled by the exact jnp tiles")
      return cfg.replace(attention_impl="xla", platform="cpu"), note
    what = "our Pallas kernels per chunk pair" if kernels else "exact jnp tiles"
    return cfg.replace(platform=backend), f"{how}: {what}, compiled for " \
        f"{backend.upper()}"
  if backend == "cpu" and platform != "cpu" and resolved != "xla":
    note = (f"attention.impl={shown}: a fused kernel on {platform.upper()}; modelled by "
            f"blockwise (flash-style) jnp attention, which has its memory profile")
    return cfg.replace(attention_impl="blockwise", platform="cpu"), note
  if resolved == "xla":
    note = f"attention.impl={shown}: whole [B, H, T, S] score tensors"
  else:
    kernel = {"cudnn": "cuDNN fused attention", "pallas": "our Pallas kernels"}[resolved]
    note = f"attention.impl={shown}: {kernel}, compiled for {backend.upper()}"
  return cfg.replace(platform=backend), note


def measure(config, devices, platform: str | None = None, *,
            with_breakdown: bool = False) -> Measurement:
  """Compiles the train step of `config` for a mesh over `devices` and measures it;
  `with_breakdown`: with the buffers live at the memory peak (`Measurement.breakdown`).

  XLA:CPU accepts the host-offload remat policies but keeps the offloaded activations in its one
  memory, so on CPU an `*_offload` policy is modelled from a second compile with `full` remat
  (what stays on the device: layer inputs and one layer's recompute); the difference is what
  the accelerator would hold in host memory. Its FLOPs are the first compile's.

  `platform` is what the run is for (default: the devices' own platform); CPU devices with an
  accelerator platform model it (see the module docstring).
  """
  m = _compile_and_measure(config, devices, platform, with_breakdown)
  policy = config.model.remat_policy
  if m.backend == "cpu" and m.platform != "cpu" and policy.endswith("_offload"):
    full = copy.deepcopy(config)
    full.model.remat_policy = "full"
    device_side = _compile_and_measure(full, devices, platform)
    m.act_host = max(0, m.temp - device_side.temp)
    m.temp = min(m.temp, device_side.temp)
    m.compile_s += device_side.compile_s
    m.remat_note = (f"{policy}: XLA:CPU does not place buffers in host memory; device "
                    f"temporaries taken from a compile with remat 'full', the rest counted as "
                    f"offloaded to host (estimate)")
  return m


def abstract_batch(config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """One global batch of the run's objective as shapes, sharded like the trainer's batches."""
  return objectives.get(config).abstract_batch(config, mesh)


def _param_shards(tree, prefix: str = "") -> list[ParamShard]:
  return [ParamShard(prefix + jax.tree_util.keystr(path, simple=True, separator=".")
                     .removesuffix(".value"), tuple(a.shape), str(a.dtype), str(a.sharding.spec),
                     _shard_bytes(a, a.sharding))
          for path, a in jax.tree_util.tree_leaves_with_path(tree)]


def compile_step(config, devices, platform: str | None = None, dump_dir: str | None = None):
  """(compiled train step, setup, abstract state, abstract batch, attention note, mesh shape):
  the step of `config` compiled for a mesh over `devices` on abstract inputs; allocates
  nothing. `dump_dir`: where the compiler writes what breakdown.read needs."""
  backend = platform_of_backend(devices[0].platform)
  platform = platform or backend
  mesh_shape = validate(config, len(devices), platform, for_run=False)
  mesh = make_mesh(mesh_shape, devices)
  model_cfg, attention_note = modelled_model_config(config, backend, platform)
  # The step exactly as the trainer builds it, frozen weights (LoRA base, DPO reference) included.
  setup = train_setup.build(config, mesh, model_cfg)
  # Options that leave buffers and FLOPs as they are but halve XLA:CPU's compile time are only
  # for programs that never run (a model of an accelerator).
  options = dict(_CPU_COMPILE_OPTIONS) if backend == "cpu" and platform != "cpu" else {}
  if dump_dir is not None:
    options.update(breakdown_lib.compile_options(dump_dir))
  compiled, state, batch = compile_setup(setup, config, options or None)
  return compiled, setup, state, batch, attention_note, mesh_shape


class CompilerOutOfMemory(Exception):
  """The compiler itself refused the program for memory (libtpu does, where XLA's GPU and CPU
  compilers report and go on); `temp` is the temporaries it asked for, per device."""

  def __init__(self, message: str, temp: int, state, batch):
    super().__init__(message)
    self.temp, self.state, self.batch = temp, state, batch


_OUT_OF_MEMORY = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def compile_setup(setup: train_setup.Setup, config, options=None, state=None):
  """(compiled train step, abstract state, abstract batch) of a built setup: what the trainer
  runs, compiled on abstract inputs before any weight exists (`state`: its abstract state, if
  already made). CompilerOutOfMemory when the compiler refuses it for memory."""
  state = state if state is not None else train_setup.abstract_state(setup, config.train.seed)
  batch = abstract_batch(config, setup.mesh)
  with jax.set_mesh(setup.mesh):
    try:
      compiled = setup.train_step.lower(state, batch).compile(options)
    except jax.errors.JaxRuntimeError as e:
      found = _OUT_OF_MEMORY.search(str(e))
      if "RESOURCE_EXHAUSTED" not in str(e) or not found:
        raise
      scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}[found.group(2)]
      raise CompilerOutOfMemory(str(e).splitlines()[0], int(float(found.group(1)) * scale),
                                state, batch) from None
  return compiled, state, batch


@dataclasses.dataclass
class StateBytes:
  """Exact per-device bytes of a train state, from its shardings."""
  params: int  # trained and frozen
  frozen: int
  opt_device: int
  opt_host: int

  @property
  def on_device(self) -> int:
    return self.params + self.opt_device


def state_bytes(state) -> StateBytes:
  opt_device = opt_host = 0
  for a in jax.tree.leaves(state.opt_state):
    if a.sharding.memory_kind in HOST_MEMORY_KINDS:
      opt_host += _shard_bytes(a, a.sharding)
    else:
      opt_device += _shard_bytes(a, a.sharding)
  trained = sum(_shard_bytes(a, a.sharding) for a in jax.tree.leaves(state.params))
  frozen = (sum(_shard_bytes(a, a.sharding) for a in jax.tree.leaves(state.frozen))
            if state.frozen is not None else 0)
  return StateBytes(trained + frozen, frozen, opt_device, opt_host)


def batch_bytes(batch) -> int:
  return sum(_shard_bytes(x, x.sharding) for x in batch.values())


def adamw_state_bytes(config, abstract_params) -> int:
  """Per-device bytes of the optimizer state the same run would keep under optim.name=adamw
  (for a Muon run's comparison), exact from the trained params' shardings."""
  adamw = config.copy_and_resolve_references()
  adamw.optim.name = "adamw"
  tx = optim.make_optimizer(adamw)
  param_shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
  mesh = jax.tree.leaves(param_shardings)[0].mesh
  abstract = jax.eval_shape(tx.init, abstract_params)
  shardings = opt_state_shardings(tx, abstract_params, param_shardings, mesh)
  return sum(_shard_bytes(a, s) for a, s in zip(jax.tree.leaves(abstract),
                                                 jax.tree.leaves(shardings)))


def compiled_bytes(compiled) -> tuple[int, int]:
  """(temporaries, new outputs) per device of a compiled step: outputs not written over the
  donated inputs count, the rest reuse the inputs' buffers."""
  memory = compiled.memory_analysis()
  return (int(memory.temp_size_in_bytes),
          max(0, int(memory.output_size_in_bytes) - int(memory.alias_size_in_bytes)))


@contextlib.contextmanager
def _not_cached():
  """Compiles inside write no entry to a persistent compilation cache (JAX skips programs that
  compiled faster than the minimum time): with memory_breakdown.compile_options, whose key no
  other compile shares, the compiler then always runs and writes its dump."""
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  try:
    yield
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _compile_and_measure(config, devices, platform: str | None = None,
                         with_breakdown: bool = False) -> Measurement:
  backend = platform_of_backend(devices[0].platform)
  # libtpu's memory_analysis() over-reports temporaries (memory_breakdown.py): TPU compiles always
  # read the buffer assignment.
  dump = with_breakdown or backend == "tpu"
  with tempfile.TemporaryDirectory(prefix="jaxtrain-xla-dump-") as dump_dir:
    start = time.perf_counter()
    try:
      with _not_cached() if dump else contextlib.nullcontext():
        compiled, setup, state, batch, attention_note, mesh_shape = compile_step(
            config, devices, platform, dump_dir=dump_dir if dump else None)
    except CompilerOutOfMemory as e:
      return _refused(config, devices, platform, e, time.perf_counter() - start)
    compile_s = time.perf_counter() - start
    found = breakdown_lib.read(dump_dir) if dump else None

  exact = state_bytes(state)
  offload_note = ""
  if config.optim.offload_state and not exact.opt_host and exact.opt_device:
    # XLA:GPU without a device has no host memory space (a deviceless topology's devices
    # address none, and with_memory_kind("pinned_host") yields no kind), so the step compiled
    # with the moments in device memory. Their bytes are exact and counted where the run keeps
    # them; the update's transient device copies are not in the compiled temporaries.
    exact = dataclasses.replace(exact, opt_device=0, opt_host=exact.opt_device)
    offload_note = (f"the moments' host placement cannot be compiled for {backend.upper()} "
                    f"without a device: their exact bytes counted in host memory, the "
                    f"update's transient device copies not modelled")
  param_shards = _param_shards(state.params)
  frozen_shards = _param_shards(state.frozen, "frozen.") if state.frozen is not None else []
  memory = compiled.memory_analysis()
  temp, outputs = compiled_bytes(compiled)
  reported_temp = None
  if backend == "tpu" and found is not None and found.temp_bytes != temp:
    reported_temp, temp = temp, found.temp_bytes
  hlo = compiled.as_text()
  counted = hlo_flops.count(hlo)
  cost = compiled.cost_analysis()  # None for deviceless GPU compiles
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  # Accelerator compilers place offloaded activations in host memory themselves.
  act_host = 0 if backend == "cpu" else int(getattr(memory, "host_temp_size_in_bytes", 0))
  return Measurement(
      num_devices=len(devices), backend=backend, platform=platform or backend, mesh=mesh_shape,
      model_cfg=setup.model_cfg, params=exact.params, opt_device=exact.opt_device,
      opt_host=exact.opt_host, batch=batch_bytes(batch), temp=temp, outputs=outputs,
      compiler_arguments=int(memory.argument_size_in_bytes),
      flops=counted.flops, xla_flops=float(cost.get("flops", np.nan)),
      loops_without_trip_count=counted.loops_without_trip_count, compile_s=compile_s,
      param_shards=param_shards + frozen_shards, attention_note=attention_note,
      frozen=exact.frozen, resident=setup.objective.resident_bytes(config, setup.mesh),
      act_host=act_host, offload_note=offload_note,
      breakdown=found if with_breakdown else None, reported_temp=reported_temp, hlo=hlo,
      adamw_opt=adamw_state_bytes(config, state.params) if config.optim.name == "muon" else 0)


def _refused(config, devices, platform, e: CompilerOutOfMemory, compile_s: float) -> Measurement:
  """The figures of a step the compiler refused for memory: exact state and batch bytes, the
  temporaries it asked for (as rounded in its message), no outputs or FLOPs."""
  backend = platform_of_backend(devices[0].platform)
  mesh_shape = validate(config, len(devices), platform or backend, for_run=False)
  model_cfg, attention_note = modelled_model_config(config, backend, platform or backend)
  exact = state_bytes(e.state)
  shards = _param_shards(e.state.params) + (
      _param_shards(e.state.frozen, "frozen.") if e.state.frozen is not None else [])
  return Measurement(
      num_devices=len(devices), backend=backend, platform=platform or backend, mesh=mesh_shape,
      model_cfg=model_cfg, params=exact.params, opt_device=exact.opt_device,
      opt_host=exact.opt_host, batch=batch_bytes(e.batch), temp=e.temp, outputs=0,
      compiler_arguments=0, flops=0.0, xla_flops=np.nan, loops_without_trip_count=0,
      compile_s=compile_s, param_shards=shards,
      attention_note=f"{attention_note}; the compiler refused the program: {e}",
      frozen=exact.frozen, resident=objectives.get(config).resident_bytes(
          config, jax.tree.leaves(e.state.params)[0].sharding.mesh),
      adamw_opt=adamw_state_bytes(config, e.state.params) if config.optim.name == "muon" else 0)


def analytic_tokens_per_step(config) -> int:
  """Tokens one step trains on (the objective's: B x T, or both responses of DPO's pairs)."""
  return objectives.get(config).tokens_per_step(config)


def analytic_flops_per_step(config) -> float:
  """The objective's analytic FLOPs of a step (metrics.flops_per_token per token, and what the
  objective adds, e.g. DPO's reference forward)."""
  return objectives.get(config).flops_per_step(config)
