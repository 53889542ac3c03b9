"""run(): sharded init, the training loop, periodic eval, metrics. The I/O edge of training.

Flow: mesh → `train_setup.build` (abstract model → shardings → jitted steps) → sharded init or
restore → loop { host batch → global array → jit train_step (donated state) → metrics fetched
one step late → writers }.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxtrain import host_memory
from jaxtrain import storage
from jaxtrain.checkpointing.checkpointer import Checkpointer, abstract_like
from jaxtrain.checkpointing.run_directory import RunDirectory
from jaxtrain.checkpointing.weights import load_params
from jaxtrain.data import shards as data_shards
from jaxtrain.data.sources import DataError
from jaxtrain.models import moe, mtp
from jaxtrain.models.config import ModelConfig
from jaxtrain.objectives import Objective
from jaxtrain.objectives.feeders import evaluate, to_global_batch  # re-exported for the loop's callers
from jaxtrain.objectives.grpo.rewards import RewardError
from jaxtrain.ops import max_logit
from jaxtrain.parallel import pipeline
from jaxtrain.parallel.mesh import DCN_AXES, MeshShape, make_mesh
from jaxtrain.peft import state as peft_state
from jaxtrain.train import metrics as metrics_lib
from jaxtrain.train import muon
from jaxtrain.train import preflight
from jaxtrain.train import wandb as wandb_logger
from jaxtrain.train.health import LossSpikeDetector, check_bad_streak
from jaxtrain.train.setup import Setup, build
from jaxtrain.train.step import MAX_METRICS, TrainState


def _optimizer_row(config, abstract_params) -> str:
  """The run table's optimizer row; `abstract_params`: the trained params (setup's)."""
  o = config.optim
  if o.name != "muon":
    return f"AdamW (b1 {o.b1:g}, b2 {o.b2:g}, weight decay {o.weight_decay:g})"
  ns_flops = muon.step_flops(abstract_params, o.muon.ns_steps)
  return (f"Muon ({o.muon.ns_steps} Newton-Schulz steps, momentum {o.muon.momentum:g}, "
          f"{o.muon.adjust_lr}) for the projection matrices, AdamW for the rest: "
          f"{muon.describe(abstract_params)}; Newton-Schulz "
          f"{metrics_lib.format_count(ns_flops)} FLOPs per step (not model FLOPs: not in MFU)")


def _start_rows(config, mesh: Mesh, mesh_shape: MeshShape, model_cfg: ModelConfig,
                peak: float | None, peak_source: str, packing: float | None,
                data_rows: list[tuple[str, str]], objective: Objective,
                abstract_params) -> list[tuple[str, str]]:
  """The run table's (name, value) rows: printed at the start, and the W&B run's config."""
  t = config.train
  flops_per_token = objective.flops_per_token(config, model_cfg)
  devices = jax.devices()
  n = len(devices)
  tokens = t.global_batch_size * t.seq_len
  per_device = t.global_batch_size / mesh_shape.batch_shards
  rows = [
      ("devices", f"{n} × {devices[0].device_kind} ({jax.process_count()} process(es))"),
      ("target", f"{config.target} (what the config is sized for; --dry_run compiles for it)"),
  ]
  if devices[0].platform == "cpu":
    rows.append(("host memory", host_memory.describe()))
  rows += [
      ("mesh", mesh_shape.describe()),
      ("parameters", f"{metrics_lib.format_count(metrics_lib.count_params(model_cfg.arch))} "
                     f"({metrics_lib.count_params(model_cfg.arch):,})"),
      ("model", model_cfg.arch.describe()),
      *filter(None, [metrics_lib.moe_row(model_cfg, mesh_shape.expert)]),
      ("global batch", f"{t.global_batch_size} seq × {t.seq_len} = {tokens:,} tokens"),
      ("per-device batch", f"{per_device:g} seq"
                           + (f" × 1/{mesh_shape.context} each" if mesh_shape.context > 1 else "")
                           + f" = {per_device * t.seq_len / mesh_shape.context:,.0f} tokens "
                           f"(grad accum {t.grad_accum_steps})"),
  ]
  if mesh_shape.stage > 1:
    stages, repeats = mesh_shape.stage, config.pipeline.repeats
    micro = pipeline.resolve_microbatches(config.pipeline.microbatches, stages)
    rows.append(("pipeline", pipeline.describe(stages, model_cfg.arch.num_layers, micro, repeats,
                                               per_device)))
  if mesh_shape.context > 1:
    layout = ("load-balanced (device i: chunks i and 2C-1-i)"
              if model_cfg.parallel.context_load_balance else "contiguous parts")
    rows.append(("context", f"sequence split over {mesh_shape.context} devices "
                            f"({t.seq_len // mesh_shape.context:,} tokens each, {layout}); "
                            f"attention {model_cfg.parallel.context_parallel}"))
  if (adapters := model_cfg.peft).lora_rank:
    counts = peft_state.parameter_counts(model_cfg)
    quant = ("" if adapters.base_quant == "none" else
             f", {metrics_lib.format_count(counts.quantized)} of them stored "
             f"{adapters.base_quant} (groups of {adapters.quant_group_size})")
    rows.append(("trained", f"LoRA rank {adapters.lora_rank} (alpha {adapters.lora_alpha:g}) "
                            f"on {','.join(adapters.lora_targets)}: {counts.trainable:,} adapter "
                            f"params ({100 * counts.trainable / counts.total:.2f}%)"))
    rows.append(("frozen base", f"{metrics_lib.format_count(counts.frozen_bytes)}B in "
                                f"{model_cfg.runtime.param_dtype}{quant}"))
  objective_rows = objective.batch_rows(config, model_cfg, per_device)
  if objective_rows is not None:  # in place of the language-model batch rows
    rows[-2:] = objective_rows
  rows += [
      ("FLOPs per token", f"{metrics_lib.format_count(flops_per_token)} "
                          f"(6·N_matmul + 6·L·T·H·E, windowed layers their window"
                          f"{objective.flops_note()})"),
      ("peak FLOP/s", f"{metrics_lib.format_count(peak) if peak else 'n/a'} total; "
                      f"{peak_source}"),
      ("optimizer", _optimizer_row(config, abstract_params)),
      ("dtypes", f"params {model_cfg.runtime.param_dtype}, compute {model_cfg.runtime.dtype}"),
      ("layers", f"{'scan' if model_cfg.runtime.scan_layers else 'unrolled'}, remat "
                 f"{model_cfg.runtime.remat_policy}, attention {model_cfg.runtime.attention_impl}"),
      ("steps", f"{t.steps} (eval every {t.eval_every}, {t.eval_batches} batches)"),
  ]
  rows += data_rows
  if packing is not None:
    rows.append(("packing efficiency", f"{100 * packing:.1f}% of target slots carry loss "
                                       f"(first batch)"))
  return rows


def run(config, workdir: str, mesh_shape: MeshShape, config_path: str = "") -> dict[str, float]:
  """Trains per `config`, writing metrics under `workdir`. Returns the final train/eval loss.

  Raises preflight.DoesNotFitError, before allocating or writing anything, when the step cannot
  fit the devices' memory (`config_path` goes into the message's dry-run command).
  """
  mesh = make_mesh(mesh_shape, dcn={axis: config.mesh[f"dcn_{axis}"] for axis in DCN_AXES})
  setup = build(config, mesh)
  # Compiled on abstract inputs and checked against the devices' memory; the loop runs it.
  setup = dataclasses.replace(setup, train_step=preflight.check(config, setup, config_path))
  t = config.train
  is_chief = jax.process_index() == 0

  objective = setup.objective
  # The objective's batches (packed documents, preference pairs): the same three functions.
  data_source = objective.data_module()
  # This process reads only the batch rows its devices hold.
  train_iter, eval_batches = data_shards.open_data(config, mesh, data_source)
  peak, peak_source = metrics_lib.peak_flops_for_devices(jax.devices(),
                                                         config.precision.matmul)
  tokens_per_step = objective.tokens_per_step(config)
  flops_per_token = objective.flops_per_token(config, setup.model_cfg)
  # A bucket --workdir is written through a local mirror (run_directory.py); `workdir` below
  # is that local directory, and checkpoints go to the bucket itself.
  run_dir = RunDirectory(workdir)
  if is_chief:
    run_dir.pull()
  ckpt = _checkpointer(config, run_dir.url or workdir,
                       before_upload=run_dir.push if is_chief and run_dir.url else None)
  workdir = run_dir.local
  state, start_step = _restore_or_init(setup, ckpt, train_iter, t.seed,
                                       config.checkpoint.init_from)
  # Taken after any restore: the iterator then continues where the checkpoint left it.
  try:
    first_batch = next(train_iter)
  except DataError:
    if ckpt:  # nothing saved yet: no empty checkpoints directory left behind
      ckpt.close_unused()
    raise
  packing = objective.packing_efficiency(first_batch)
  writer = None
  if is_chief:
    rows = _start_rows(config, mesh, mesh_shape, setup.model_cfg, peak, peak_source, packing,
                       data_source.summary(config), objective, setup.abstract_params)
    print(metrics_lib.format_table(rows), flush=True)
    if start_step:
      print(f"resumed from step {start_step}: {ckpt.directory}/{start_step}", flush=True)
      _drop_metrics_after(workdir, start_step)
    else:
      _set_aside_previous_metrics(workdir)
    wandb_run = (wandb_logger.WandbLogger(config, workdir, rows, resumed=start_step > 0)
                 if config.log.wandb else None)
    writer = metrics_lib.MetricsWriter(workdir, tensorboard=config.log.tensorboard,
                                       total_steps=t.steps, wandb=wandb_run)
    run_dir.start()
  meter = _Throughput(tokens_per_step, flops_per_token, peak)
  feeder = objective.make_feeder(config, setup, workdir)

  def next_local():
    nonlocal first_batch
    start = time.perf_counter()
    local, first_batch = (first_batch, None) if first_batch is not None else (next(train_iter),
                                                                              None)
    meter.data_wait_s += time.perf_counter() - start
    return local
  pending = None  # (step, device metrics), fetched after the next step is dispatched
  previous_streak = None  # the last step's bad_streak, read one step late (no stall)
  last: dict[str, float] = {}
  saved_step = start_step
  skipped_steps = 0  # updates skipped for non-finite values, this session
  spikes = LossSpikeDetector(t.loss_spike_sigmas)
  stop = _StopOnSignal()
  try:
    with jax.set_mesh(mesh), stop:
      for step in range(start_step + 1, t.steps + 1):
        data_state = train_iter.get_state() if ckpt else None
        try:
          batch, host_metrics = feeder.next_batch(state, step, next_local)
        except RewardError:
          # Nothing is lost: the last finished step is saved, with the data where it stood
          # before this step's prompts, so a resumed run (reward function fixed) retries them.
          if ckpt and saved_step != step - 1 and step > start_step + 1:
            train_iter.set_state(data_state)
            ckpt.save(step - 1, checkpointed(state), train_iter, _meta(config, step - 1))
          raise
        state, step_metrics = setup.train_step(state, batch)
        if step == start_step + 1:
          # Step 1 includes compilation; throughput is measured from its end.
          jax.block_until_ready(step_metrics)
          meter.restart(step)
        if previous_streak is not None:
          streak = int(previous_streak)
          skipped_steps += streak > 0
          check_bad_streak(streak, step - 1, t.max_consecutive_bad_steps, ckpt)
        previous_streak = step_metrics["bad_streak"]
        if pending is not None:
          last.update(_log(writer, meter, spikes, *pending, skipped_steps=skipped_steps,
                           metric_names=objective.metric_names))
          pending = None
        if step % t.log_every == 0 or step == t.steps:
          pending = (step, {**step_metrics, **host_metrics})
        if ckpt and ckpt.should_save(step, t.steps) and feeder.at_boundary(step):
          if pending is not None and pending[0] == step:
            # The save waits for this step's state anyway, so its metrics are logged now: a
            # checkpoint is never newer than the metrics.jsonl beside it (pushed before it
            # counts as complete on a bucket).
            last.update(_log(writer, meter, spikes, *pending, skipped_steps=skipped_steps,
                             metric_names=objective.metric_names))
            pending = None
          # Blocks only to copy the state off the devices; files are written in the background.
          ckpt.save(step, checkpointed(state), train_iter, _meta(config, step))
          saved_step = step
        if step % t.eval_every == 0 or step == t.steps:
          # Finish the queued train steps first: only the eval itself is excluded from
          # the throughput interval.
          jax.block_until_ready(state.params)
          eval_start = time.perf_counter()
          evaluated = feeder.evaluate(state, step, eval_batches)
          last["eval_loss"] = evaluated.pop("eval_loss")
          last.update(evaluated)
          if writer:
            writer.write_eval(step, last["eval_loss"], **evaluated)
          meter.exclude(time.perf_counter() - eval_start)
        if stop.poll(step) and feeder.at_boundary(step):
          if ckpt and saved_step != step:
            ckpt.save(step, checkpointed(state), train_iter, _meta(config, step))
          if ckpt:
            ckpt.wait()
          last["preempted_at"] = step
          if is_chief:
            where = (f"checkpoint of step {step} saved in {ckpt.directory}; rerun the same "
                     f"command to resume" if ckpt else "no checkpoint (checkpoint.every_steps=0)")
            print(f"stopping after step {step} on {stop.signal_name}: {where}", flush=True)
          break
      if previous_streak is not None:
        skipped_steps += int(previous_streak) > 0
      if pending is not None:
        last.update(_log(writer, meter, spikes, *pending, skipped_steps=skipped_steps,
                         metric_names=objective.metric_names))
      if previous_streak is not None and "preempted_at" not in last:
        check_bad_streak(int(previous_streak), t.steps, t.max_consecutive_bad_steps, ckpt)
  finally:
    try:
      if writer:
        writer.close()
      if ckpt:
        ckpt.close()  # waits for the last save to be committed (and uploaded)
    finally:
      if is_chief:
        run_dir.close()  # the last metrics to the bucket, also when the run failed
  return {"loss": last.get("loss", float("nan")), "eval_loss": last.get("eval_loss", float("nan")),
          "preempted_at": last.get("preempted_at"),
          **{k: v for k, v in last.items() if k.startswith("eval_") and k != "eval_loss"}}


class _StopOnSignal:
  """SIGTERM/SIGINT: finish the current step, checkpoint, exit cleanly. A second signal
  aborts at once (exit code 1).

  Multi-process runs must stop at the same step on every process (the final save is a
  collective), so there the signal is left to JAX's distributed runtime: its preemption service
  catches SIGTERM (the scheduler's preemption notice) on any process, shares it, and names a
  common step, which `poll` checks once per step (multihost_utils.reached_preemption_sync_point).
  """

  def __init__(self, multi_process: bool | None = None):
    self.requested, self.signal_name, self._previous = False, "", {}
    self._sync = jax.process_count() > 1 if multi_process is None else multi_process

  def _handle(self, signum, _frame):
    if self.requested:
      os._exit(1)  # pylint: disable=protected-access
    self.requested, self.signal_name = True, signal.Signals(signum).name

  def poll(self, step: int) -> bool:
    """Whether to stop after `step` (call once per step, on every process)."""
    if self._sync and not self.requested:
      try:
        if multihost_utils.reached_preemption_sync_point(step):
          self.requested, self.signal_name = True, "the preemption notice"
      except RuntimeError as e:  # the preemption service is disabled
        self._sync = False
        if jax.process_index() == 0:
          print(f"warning: no preemption sync point ({e}); SIGTERM will end this multi-process "
                f"run without a final checkpoint", flush=True)
    return self.requested

  def __enter__(self):
    if not self._sync and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _meta(config, step: int) -> dict:
  return {"step": step, "config": config.to_dict()}


def _checkpointer(config, workdir: str, before_upload=None) -> Checkpointer | None:
  c = config.checkpoint
  if c.every_steps <= 0:
    return None
  return Checkpointer(c.directory or storage.join(workdir, "checkpoints"),
                      every_steps=c.every_steps, max_to_keep=c.max_to_keep or None,
                      keep_period=c.keep_every or None, async_save=c.async_save,
                      before_upload=before_upload, on_unreadable=c.on_unreadable)


def _restore_or_init(setup: Setup, ckpt: Checkpointer | None, train_iter, seed: int,
                     init_from: str = "") -> tuple[TrainState, int]:
  """(state, step): the latest complete checkpoint restored onto this run's shardings (the data
  iterator too); else a fresh state at step 0 whose params come from `init_from` when given,
  from a sharded random init otherwise. Frozen weights (the LoRA base, the DPO reference) are
  never checkpointed: they are rebuilt here, from `init_from` or the seed's random init, on
  every start and resume."""
  with jax.set_mesh(setup.mesh):
    shapes = jax.eval_shape(setup.init_fn, jax.random.key(seed))
  state, step = None, 0
  if ckpt is not None:  # (None, None) when there is no checkpoint: one listing, not two
    state, step = ckpt.restore_latest(abstract_like(shapes, setup.shardings), train_iter)
    step = step or 0
  lora = setup.model_cfg.peft.lora_rank > 0
  chief = jax.process_index() == 0

  def base_params(what: str, note: str = ""):
    """The plain model's params: from init_from, else the seed's random init."""
    if not init_from:
      with jax.set_mesh(setup.mesh):
        return setup.base_init_fn(jax.random.key(seed))
    params, source = load_params(init_from, setup.abstract_base)
    if chief:
      print(f"{what} from {source}{note}", flush=True)
    return params

  fresh = state is None
  with jax.set_mesh(setup.mesh):
    if state is None:
      if lora:
        state = setup.init_fn(jax.random.key(seed))  # fresh adapters; the base comes below
      elif init_from:
        state = setup.state_from_params(
            base_params("initialized params", " (optimizer state fresh, step 0)"))
      else:
        state = setup.init_fn(jax.random.key(seed))
    if setup.make_frozen is not None:
      if chief and not init_from:
        print(f"warning: {'LoRA base' if lora else 'reference'} weights are a random init "
              f"(no checkpoint.init_from): fine for a smoke test, meaningless for fine-tuning",
              flush=True)
      what = "frozen base weights" if lora else f"{setup.objective.name.upper()} reference weights"
      base = base_params(what)
      if fresh and setup.heads_from_base is not None:  # LoRA: the heads start from the base's
        state = state.replace(params=setup.heads_from_base(state.params, base))
      state = state.replace(frozen=setup.make_frozen(base))
  return state, step


def checkpointed(state: TrainState) -> TrainState:
  """What a checkpoint holds: the state without its frozen weights (rebuilt on resume)."""
  return state.replace(frozen=None)


def _drop_metrics_after(workdir: str, step: int):
  """A resumed run recomputes the steps after its checkpoint: their records from the
  interrupted run are removed so metrics.jsonl has each step once."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  kept = [l for l in lines if l.strip() and _record_step(l) <= step]
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)


def _record_step(line: str) -> int:
  try:
    return int(json.loads(line).get("step", 0))
  except ValueError:  # a line cut short by a hard kill
    return 1 << 62


def _set_aside_previous_metrics(workdir: str):
  """A run that starts at step 0 must not append to an earlier run's metrics.jsonl: the earlier
  file is kept, renamed metrics.prev-N.jsonl, and the new run gets a fresh one."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return
  n = 1
  while os.path.exists(os.path.join(workdir, f"metrics.prev-{n}.jsonl")):
    n += 1
  moved = os.path.join(workdir, f"metrics.prev-{n}.jsonl")
  os.rename(path, moved)
  print(f"note: {path} from an earlier run kept as {moved}", flush=True)


class _Throughput:
  """Tokens/s and MFU over the steps between two logged steps (eval time excluded)."""

  def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None):
    self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
    self.start_time, self.start_step, self.data_wait_s, self.paused_s = None, 0, 0.0, 0.0

  def restart(self, step: int):
    self.start_time, self.start_step = time.perf_counter(), step
    self.data_wait_s = self.paused_s = 0.0

  def exclude(self, seconds: float):
    """Time spent outside training (eval) in the current interval."""
    self.paused_s += seconds

  def measure(self, step: int) -> dict[str, float | None]:
    steps = step - self.start_step
    elapsed = (time.perf_counter() - self.start_time - self.paused_s) if self.start_time else 0.0
    if steps <= 0 or elapsed <= 0:
      return {"tokens_per_sec": None, "mfu": None, "data_wait_s": None}
    tokens_per_sec = self.tokens_per_step * steps / elapsed
    out = {"tokens_per_sec": tokens_per_sec,
           "mfu": metrics_lib.mfu(tokens_per_sec, self.flops_per_token, self.peak),
           "data_wait_s": self.data_wait_s / steps}
    self.restart(step)
    return out


def _log(writer, meter: _Throughput, spikes: LossSpikeDetector, step: int, device_metrics, *,
         skipped_steps: int = 0, metric_names: tuple[str, ...] = ()) -> dict[str, float]:
  m = {k: None if v is None else float(v) for k, v in jax.device_get(device_metrics).items()}
  spike = spikes.update(m["loss"])
  if spike and writer:
    print(f"warning: step {step}: {spike}", flush=True)
  record = {"loss": m["loss"], "learning_rate": m["learning_rate"],
            "grad_norm": m["grad_norm"], **meter.measure(step), "tokens": m["tokens"],
            "skipped": m["skipped"], "skipped_steps": skipped_steps,
            "loss_spikes": spikes.spikes}
  # A max over no elements (-inf: e.g. logprob_mismatch of a warm-up step, which sampled no
  # tokens) is left out, as metrics that do not apply are.
  record.update({k: m[k] for k in (metric_names + moe.METRIC_NAMES + mtp.METRIC_NAMES
                                   + max_logit.METRIC_NAMES)
                 if k in m and not (k in MAX_METRICS and m[k] == float("-inf"))})
  if writer:
    writer.write_train(step, record)
  return {"loss": m["loss"]}


__all__ = ["checkpointed", "evaluate", "run", "to_global_batch"]
