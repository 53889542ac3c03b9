"""The one validation pass over a run config, and the mesh shape it resolves.

`validate()` runs before anything is compiled. Every check raises `ConfigError` with one line: the
key, the bad value, and how to fix it (the CLI prints it and exits with code 2).
"""

from __future__ import annotations

import importlib.util
import math
import os

from jaxtrain import hardware as targets
from jaxtrain import objectives
from jaxtrain.config import (ATTENTION_IMPLS, DTYPES, MATMUL_PRECISIONS, REMAT_POLICIES,
                             ROPE_SCALING_TYPES, STATE_DTYPES, ConfigError,
                             lora_targets)
from jaxtrain.models import registry
from jaxtrain.models.config import LAYER_TYPES, SLIDING, parse_layer_types
from jaxtrain.ops.attention import CUDNN_MAX_HEAD_DIM, cudnn_takes
from jaxtrain.parallel.context_parallel import STRATEGIES as CONTEXT_STRATEGIES
from jaxtrain.parallel.mesh import MESH_AXES, MeshShape, check_divides, param_dims, resolve_shape
from jaxtrain.parallel.pipeline import resolve_microbatches
from jaxtrain.validation.finetuning import check_finetuning
from jaxtrain.validation.moe import (check_latent_attention, check_moe,
                                     check_multi_token_prediction)
from jaxtrain.validation.multihost import check_multihost
from jaxtrain.validation.optimizer import check_max_logit, check_optimizer


def resolve_mesh_shape(config, num_devices: int) -> MeshShape:
  """The config's mesh sizes with the one -1 axis filled; ConfigError when impossible."""
  try:
    return resolve_shape({axis: config.mesh.get(axis, 1) for axis in MESH_AXES}, num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _check_cudnn_lengths(config, platform: str):
  """cuDNN's fused attention trains with a mask (packed documents) only on even lengths; a DPO
  row is a prompt and response of train.seq_len + 1 tokens."""
  impl = config.attention.impl
  if platform != "gpu" or impl not in ("cudnn", "auto"):
    return
  if not cudnn_takes(config.model.head_dim):
    if impl == "cudnn":
      raise ConfigError(f"attention.impl='cudnn': cuDNN's fused attention takes head dims up to "
                        f"{CUDNN_MAX_HEAD_DIM} in multiples of 8, not model.head_dim="
                        f"{config.model.head_dim}; use attention.impl='pallas' or 'auto'")
    return  # auto: our Pallas kernels
  t = config.train
  objective = objectives.get(config)
  length = objective.row_length(t.seq_len)
  if length % 2:
    row = objective.describe_row(t.seq_len)
    raise ConfigError(f"train.seq_len={t.seq_len}: {row}, and cuDNN attention (attention.impl="
                      f"{impl!r} on GPU) needs an even length; use train.seq_len="
                      f"{t.seq_len - 1}, or attention.impl='pallas'")


def _check_context(config, mesh: MeshShape):
  """attention.context_parallel / load_balance against mesh.context and the sequence length."""
  a, t = config.attention, config.train
  if a.context_parallel not in CONTEXT_STRATEGIES:
    raise ConfigError(f"attention.context_parallel={a.context_parallel!r}: choose one of "
                      f"{', '.join(CONTEXT_STRATEGIES)}")
  if not isinstance(a.load_balance, bool):
    raise ConfigError(f"attention.load_balance={a.load_balance!r}: must be True or False")
  shards = mesh.context
  if a.context_parallel == "ring" and shards == 1:
    raise ConfigError("attention.context_parallel='ring': needs mesh.context > 1 (keys and "
                      "values travel around the context devices, and mesh.context=1 has none); "
                      "set --config.mesh.context to 2 or more, or use 'all_gather'")
  if shards == 1:
    return
  objective = objectives.get(config)
  length = objective.row_length(t.seq_len)
  extra = length - t.seq_len  # tokens a row has beyond train.seq_len (DPO: 1)
  parts = 2 * shards if a.load_balance else shards
  if length % parts:
    row = objective.describe_row(t.seq_len)
    how = (f"2*mesh.context = {parts} chunks (the load-balanced layout: device i holds chunks i "
           f"and {parts - 1}-i)" if a.load_balance else f"mesh.context = {parts} parts")
    fix = (length // parts) * parts - extra
    fix = fix if fix > 0 else parts - extra
    other = (", or attention.load_balance=False (contiguous parts, slower causal attention)"
             if a.load_balance and length % shards == 0 else "")
    raise ConfigError(f"train.seq_len={t.seq_len}: {row} does not split into {how}; use "
                      f"train.seq_len={fix}{other}")


def _check_family(config):
  """model.family and the architecture keys only some families use."""
  m = config.model
  try:
    family = registry.get(m.family)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if m.sliding_window < 0:
    raise ConfigError(f"model.sliding_window={m.sliding_window}: must be >= 0 (0: no window)")
  layer_types = parse_layer_types(m.layer_types)
  bad = [t for t in layer_types if t not in LAYER_TYPES]
  if bad:
    raise ConfigError(f"model.layer_types: {bad[0]!r} is not a layer type; give one of "
                      f"{', '.join(LAYER_TYPES)} per layer, comma-separated")
  if layer_types and len(layer_types) != m.num_layers:
    raise ConfigError(f"model.layer_types: {len(layer_types)} entries for model.num_layers="
                      f"{m.num_layers}; give one per layer (or '' for all alike)")
  if SLIDING in layer_types and not m.sliding_window:
    raise ConfigError("model.layer_types: names sliding layers but model.sliding_window=0; set "
                      "the window size")
  for key in ("local_rope_theta", "query_pre_attn_scalar"):
    if m[key] < 0:
      raise ConfigError(f"model.{key}={m[key]}: must be >= 0 (0: the default)")
  if m.rope_scaling.type == "linear" and m.rope_scaling.factor <= 0:
    raise ConfigError(f"model.rope_scaling.factor={m.rope_scaling.factor}: must be positive")
  if config.lora.rank > 0:
    refused = [t for t in lora_targets(config) if t not in family.lora_targets]
    if refused:
      raise ConfigError(f"lora.targets: {refused[0]!r} is not a projection model.family="
                        f"{family.name!r} can adapt; choose from "
                        f"{', '.join(family.lora_targets)}")


def _check_pipeline(config, mesh: MeshShape):
  """mesh.stage and pipeline.* against the layers and the batch (jaxtrain.parallel.pipeline)."""
  p, m, t = config.pipeline, config.model, config.train
  if p.repeats < 1:
    raise ConfigError(f"pipeline.repeats={p.repeats}: must be >= 1 (1: no circular schedule)")
  if p.microbatches < 0:
    raise ConfigError(f"pipeline.microbatches={p.microbatches}: must be >= 0 (0: as many as "
                      f"mesh.stage)")
  if not isinstance(p.gather_weights_once, bool):
    raise ConfigError(f"pipeline.gather_weights_once={p.gather_weights_once!r}: must be True or "
                      f"False")
  stages = mesh.stage
  if stages == 1:
    return
  if not m.scan_layers:
    raise ConfigError("model.scan_layers=False: pipeline stages (mesh.stage > 1) split the "
                      "stacked layers; set model.scan_layers=True")
  if mesh.context > 1:
    raise ConfigError(f"mesh.stage={stages} with mesh.context={mesh.context}: pipeline stages "
                      f"and context parallelism do not combine yet; use one of them")
  groups = stages * p.repeats
  if m.num_layers % groups:
    raise ConfigError(f"model.num_layers={m.num_layers}: does not split into mesh.stage*"
                      f"pipeline.repeats={stages}*{p.repeats}={groups} equal groups of layers; "
                      f"choose a stage count and repeats whose product divides it")
  micro = resolve_microbatches(p.microbatches, stages)
  if micro % stages:
    raise ConfigError(f"pipeline.microbatches={micro}: must be a multiple of mesh.stage="
                      f"{stages} (every stage needs a microbatch in flight); use "
                      f"{max(stages, micro // stages * stages)}")
  # A step is one pipeline pass over `micro` microbatches: they are the unit of accumulation,
  # so each of train.grad_accum_steps' microbatches is micro/grad_accum_steps of them.
  if micro % t.grad_accum_steps:
    raise ConfigError(f"pipeline.microbatches={micro}: must be a multiple of "
                      f"train.grad_accum_steps={t.grad_accum_steps} (under pipeline stages the "
                      f"pipeline's microbatches are the accumulation unit); use "
                      f"{micro * t.grad_accum_steps // math.gcd(micro, t.grad_accum_steps)}")
  rows = mesh.batch_shards * micro
  if t.global_batch_size % rows:
    keys, sizes = mesh.batch_keys()
    raise ConfigError(f"train.global_batch_size={t.global_batch_size}: must be divisible by "
                      f"{keys}*pipeline.microbatches={sizes}*"
                      f"{micro}={rows} (each pipeline microbatch needs rows on every "
                      f"data-parallel device); use a multiple of {rows}")


def _positive(config, key: str):
  node = config
  for part in key.split("."):
    node = node[part]
  if node is None or node <= 0:
    raise ConfigError(f"{key}={node}: must be a positive number")


def _check_mxfp8(config) -> None:
  """MXFP8 scales 32-element blocks along every contracting dim: the projections' input and
  output sizes and the tokens must be multiples of 32; not yet with experts, latent attention
  or pipeline stages."""
  m = config.model
  if config.moe.num_experts or m.kv_lora_rank:
    what = "Mixture-of-Experts layers" if config.moe.num_experts else "latent attention"
    raise ConfigError(f"precision.matmul='mxfp8': not implemented for {what} yet; use "
                      f"precision.matmul='fp8'")
  if config.mesh.stage > 1:
    raise ConfigError(f"precision.matmul='mxfp8': not with pipeline stages (mesh.stage="
                      f"{config.mesh.stage}) yet: the stages' vmap cannot batch the block-scaled "
                      f"matmul's partitioning; use precision.matmul='fp8' or mesh.stage=1")
  sizes = {"model.d_model": m.d_model, "model.mlp_dim": m.mlp_dim,
           "model.num_heads * model.head_dim": m.num_heads * m.head_dim,
           "model.num_kv_heads * model.head_dim": m.num_kv_heads * m.head_dim,
           "train.seq_len": config.train.seq_len}
  for name, size in sizes.items():
    if size % 32:
      raise ConfigError(f"precision.matmul='mxfp8': {name}={size} is not a multiple of 32 "
                        f"(the format scales blocks of 32 along each matmul's contracting dim)")


def validate(config, num_devices: int, platform: str = "cpu", *,
             num_processes: int | None = None, num_slices: int = 1,
             for_run: bool = True) -> MeshShape:
  """Checks everything that can be checked before compiling. Returns the resolved mesh shape.

  `platform` is the JAX backend ("cpu", "gpu", "tpu") for backend-specific choices.
  `num_processes` and `num_slices` (TPU slices) are the run's hosts, for the multi-host keys;
  None (dry runs, which emulate devices in one process) skips the checks against them.
  `for_run=False` (dry runs, the preflight compile) skips what only a run needs: W&B logging.

  Raises ConfigError with one line: the key, the bad value, and how to fix it.
  """
  try:
    targets.parse(config.target)
  except targets.TargetError as e:
    raise ConfigError(f"target: {e}") from None
  for key in ("model.vocab_size", "model.num_layers", "model.d_model", "model.num_heads",
              "model.num_kv_heads", "model.head_dim", "model.mlp_dim", "model.norm_eps",
              "model.rope_theta", "model.max_position_embeddings", "train.steps",
              "train.global_batch_size", "train.seq_len", "train.grad_accum_steps",
              "train.log_every", "train.eval_every", "train.eval_batches",
              "train.loss_chunk_size", "train.max_consecutive_bad_steps",
              "optim.learning_rate"):
    _positive(config, key)
  for key in ("optim.warmup_steps", "optim.weight_decay", "optim.grad_clip_norm",
              "optim.min_lr_ratio"):
    group, name = key.split(".")
    if config[group][name] < 0:
      raise ConfigError(f"{key}={config[group][name]}: must be >= 0")
  if config.optim.decay_steps is not None and config.optim.decay_steps <= 0:
    raise ConfigError(f"optim.decay_steps={config.optim.decay_steps}: must be positive, or None "
                      f"to decay over train.steps")

  m = config.model
  if m.remat_policy not in REMAT_POLICIES:
    raise ConfigError(f"model.remat_policy={m.remat_policy!r}: unknown remat policy; choose one "
                      f"of {', '.join(REMAT_POLICIES)}")
  if config.precision.matmul not in MATMUL_PRECISIONS:
    raise ConfigError(f"precision.matmul={config.precision.matmul!r}: unknown; choose one of "
                      f"{', '.join(MATMUL_PRECISIONS)}")
  if config.precision.fp8_head and config.precision.matmul != "fp8":
    raise ConfigError(f"precision.fp8_head=True: the head follows the projections into FP8; "
                      f"set precision.matmul='fp8' (it is {config.precision.matmul!r})")
  if config.precision.fp8_head and config.train.objective != "lm":
    raise ConfigError(f"precision.fp8_head=True: the language-model loss only (train.objective="
                      f"{config.train.objective!r}); the DPO and GRPO losses keep their head in "
                      f"the compute dtype")
  if config.precision.matmul == "mxfp8":
    _check_mxfp8(config)
  if config.attention.impl not in ATTENTION_IMPLS:
    raise ConfigError(f"attention.impl={config.attention.impl!r}: unknown attention "
                      f"implementation; choose one of {', '.join(ATTENTION_IMPLS)}")
  if config.attention.impl == "cudnn" and platform != "gpu":
    raise ConfigError(f"attention.impl='cudnn': needs a GPU, this backend is {platform!r}; use "
                      f"'xla' or 'auto'")
  if (config.attention.impl == "pallas" and platform not in ("gpu", "tpu")
      and not config.attention.interpret):
    raise ConfigError(f"attention.impl='pallas': the kernels compile for GPU or TPU, this backend "
                      f"is {platform!r}; set attention.interpret=True to run them in the Pallas "
                      f"interpreter (slow, for tests), or use 'xla'")
  check_finetuning(config)  # the objective first: the length checks ask it for its rows
  _check_cudnn_lengths(config, platform)
  for key in ("block_q", "block_k"):
    if config.attention[key] < 0:
      raise ConfigError(f"attention.{key}={config.attention[key]}: must be >= 0 (0: the "
                        f"backend's default block)")
  if m.rope_scaling.type not in ROPE_SCALING_TYPES:
    raise ConfigError(f"model.rope_scaling.type={m.rope_scaling.type!r}: choose one of "
                      f"{', '.join(ROPE_SCALING_TYPES)}")
  if m.param_dtype not in DTYPES:
    raise ConfigError(f"model.param_dtype={m.param_dtype!r}: choose one of {', '.join(DTYPES)}")
  if m.dtype not in DTYPES + ("auto",):
    raise ConfigError(f"model.dtype={m.dtype!r}: choose one of {', '.join(DTYPES)} or 'auto' "
                      f"(bfloat16 on accelerators, float32 on CPU)")
  check_optimizer(config)
  if config.optim.state_dtype not in STATE_DTYPES:
    raise ConfigError(f"optim.state_dtype={config.optim.state_dtype!r}: choose one of "
                      f"{', '.join(STATE_DTYPES)}")
  _check_host_memory(config, platform)
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(f"model.num_kv_heads={m.num_kv_heads}: must divide model.num_heads="
                      f"{m.num_heads} (grouped-query attention); pick a divisor of it")
  if m.head_dim % 2:
    raise ConfigError(f"model.head_dim={m.head_dim}: must be even for rotary embeddings")
  _check_family(config)

  mesh = resolve_mesh_shape(config, num_devices)
  try:
    check_divides(mesh, param_dims(config))
  except ValueError as e:
    raise ConfigError(str(e)) from None
  _check_context(config, mesh)
  check_moe(config, mesh)
  check_latent_attention(config)
  check_multi_token_prediction(config, mesh)
  if mesh.context > 1 and config.model.sliding_window:
    raise ConfigError(f"model.sliding_window={config.model.sliding_window}: sliding-window "
                      f"attention under context parallelism (mesh.context={mesh.context}) is not "
                      f"supported; use mesh.context=1 (a window bounds attention's memory anyway)")
  _check_pipeline(config, mesh)
  check_max_logit(config, mesh)

  t = config.train
  per_step = mesh.batch_shards * t.grad_accum_steps
  rows, rows_note = objectives.get(config).rows_per_step(config), ""
  if rows != t.global_batch_size:  # GRPO: prompts x completions
    rows_note = f" (its {rows} rows: {objectives.get(config).describe_rows(config)})"
  if rows % per_step:
    keys, sizes = mesh.batch_keys()
    raise ConfigError(
        f"train.global_batch_size={t.global_batch_size}{rows_note}: must be divisible by "
        f"{keys}*train.grad_accum_steps={sizes}*"
        f"{t.grad_accum_steps}={per_step}; use a multiple of {per_step}")
  if t.seq_len > m.max_position_embeddings:
    raise ConfigError(f"train.seq_len={t.seq_len}: exceeds model.max_position_embeddings="
                      f"{m.max_position_embeddings}; shorten the sequence or raise the limit")
  if m.rope_scaling.type == "llama3":
    rs = m.rope_scaling
    if rs.factor <= 0 or rs.original_max_position_embeddings <= 0:
      raise ConfigError(f"model.rope_scaling.factor={rs.factor}: factor and "
                        f"original_max_position_embeddings must be positive")
    if rs.high_freq_factor <= rs.low_freq_factor:
      raise ConfigError(f"model.rope_scaling.high_freq_factor={rs.high_freq_factor}: must exceed "
                        f"low_freq_factor={rs.low_freq_factor}")
  if m.rope_scaling.type == "yarn":
    _check_yarn(m.rope_scaling)
  for key in ("every_steps", "max_to_keep", "keep_every"):
    if config.checkpoint[key] < 0:
      raise ConfigError(f"checkpoint.{key}={config.checkpoint[key]}: must be >= 0")
  if config.checkpoint.on_unreadable not in ("stop", "restart"):
    raise ConfigError(f"checkpoint.on_unreadable={config.checkpoint.on_unreadable!r}: must be "
                      f"'stop' or 'restart'")
  init_from = config.checkpoint.init_from
  if init_from and "://" not in init_from and not os.path.isdir(init_from):
    raise ConfigError(f"checkpoint.init_from={init_from!r}: no such directory; give a run's "
                      f"checkpoint step directory, its workdir, or a converted-weights directory")
  if config.train.loss_spike_sigmas < 0:
    raise ConfigError(f"train.loss_spike_sigmas={config.train.loss_spike_sigmas}: must be >= 0 "
                      f"(0 turns spike detection off)")
  if config.data.num_workers < 0:
    raise ConfigError(f"data.num_workers={config.data.num_workers}: must be >= 0")
  if not 0.0 < config.data.eval_fraction < 1.0:
    raise ConfigError(f"data.eval_fraction={config.data.eval_fraction}: must be in (0, 1)")
  check_multihost(config, mesh, num_processes, num_slices)
  if for_run:  # a dry run compiles and logs nothing: W&B need not be installed for it
    _check_wandb(config)
  return mesh


def wandb_installed() -> bool:
  """Whether the `wandb` package is installed (found, not imported: the check is cheap)."""
  return importlib.util.find_spec("wandb") is not None


def _check_wandb(config):
  """log.wandb=True needs the `wandb` extra (found on the path, not imported: cheap) and a
  project to log to."""
  if not config.log.wandb:
    return
  if not wandb_installed():
    raise ConfigError("log.wandb=True: the wandb package is not installed; install the extra "
                      "with `pip install -e \".[wandb]\"` or set log.wandb=False")
  if not config.log.wandb_project:
    raise ConfigError("log.wandb_project='': W&B needs a project to log to; set "
                      "--config.log.wandb_project=NAME")


def host_memory_kinds(platform: str) -> set[str] | None:
  """Memory kinds of `platform`'s devices in this process, or None when it has none here (a
  dry run checks a config for accelerators it does not have)."""
  import jax  # pylint: disable=import-outside-toplevel  (validation of other keys needs no jax)
  try:
    devices = jax.devices(platform)
  except RuntimeError:
    return None
  return {memory.kind for memory in devices[0].addressable_memories()}


def _check_host_memory(config, platform: str):
  """Offload options need a backend whose devices can address pinned host memory."""
  wanted = []
  if config.model.remat_policy.endswith("_offload"):
    wanted.append(f"model.remat_policy={config.model.remat_policy!r}")
  if config.optim.offload_state:
    wanted.append("optim.offload_state=True")
  if not wanted:
    return
  kinds = host_memory_kinds(platform)
  if kinds is not None and "pinned_host" not in kinds:
    raise ConfigError(f"{' and '.join(wanted)}: the {platform!r} backend has no pinned_host "
                      f"memory (its devices address {', '.join(sorted(kinds))}); use a remat "
                      f"policy without _offload and optim.offload_state=False")


def _check_yarn(rs) -> None:
  """YaRN's fields (models/rope.py): a positive factor and original length, beta_fast at or
  above beta_slow above 0 (equal: a ramp of one dim, as Kimi K2 has), mscales >= 0."""
  if rs.factor <= 0 or rs.original_max_position_embeddings <= 0:
    raise ConfigError(f"model.rope_scaling.factor={rs.factor}, original_max_position_embeddings="
                      f"{rs.original_max_position_embeddings}: yarn needs both positive")
  if not 0 < rs.beta_slow <= rs.beta_fast:
    raise ConfigError(f"model.rope_scaling.beta_fast={rs.beta_fast}, beta_slow={rs.beta_slow}: "
                      f"yarn needs beta_fast >= beta_slow > 0 (rotations over the original "
                      f"context; DeepSeek-V3: 32 and 1)")
  for key in ("mscale", "mscale_all_dim"):
    if rs[key] < 0:
      raise ConfigError(f"model.rope_scaling.{key}={rs[key]}: must be >= 0 (0: unset)")
