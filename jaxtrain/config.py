"""Config defaults, the one validation pass, and values derived from a config.

Every config in `configs/` starts from `default_config()` and overrides fields. `validate()` runs
before anything is compiled; it raises `ConfigError` naming the key, the value and the fix, which
the CLI prints as one line before exiting with code 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import ml_collections
from ml_collections import config_dict

# The offload variants keep what their base policy saves in pinned host memory (model.py).
REMAT_POLICIES = ("none", "full", "minimal", "save_dots", "save_qkv_proj", "minimal_offload",
                  "save_dots_offload", "save_qkv_proj_offload")
ATTENTION_IMPLS = ("xla", "pallas", "cudnn", "auto")
ROPE_SCALING_TYPES = ("none", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
# Adam moments: float16 is refused, its range underflows the second moment of small grads.
STATE_DTYPES = ("float32", "bfloat16")
OBJECTIVES = ("lm", "dpo")
# Projections that can carry LoRA adapters: attention q/k/v/o and the SwiGLU MLP's three.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Storage of the frozen base weights under LoRA (QLoRA when quantized): int8 and 4-bit codes
# (int4: uniform levels, nf4: the normal-float levels of QLoRA) with per-group scales.
BASE_QUANTIZATIONS = ("none", "int8", "int4", "nf4")


class ConfigError(ValueError):
  """A config value that cannot work; the message names key, value and fix on one line."""


def default_config() -> ml_collections.ConfigDict:
  """All keys with defaults; a config file overrides what differs."""
  c = ml_collections.ConfigDict()

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 32000
  c.model.num_layers = 2
  c.model.d_model = 256
  c.model.num_heads = 4
  c.model.num_kv_heads = 4
  c.model.head_dim = 64
  c.model.mlp_dim = 1024
  c.model.norm_eps = 1e-5
  c.model.rope_theta = 10000.0
  c.model.rope_scaling = ml_collections.ConfigDict()
  c.model.rope_scaling.type = "none"  # "none" | "llama3"
  c.model.rope_scaling.factor = 8.0
  c.model.rope_scaling.low_freq_factor = 1.0
  c.model.rope_scaling.high_freq_factor = 4.0
  c.model.rope_scaling.original_max_position_embeddings = 8192
  c.model.max_position_embeddings = 8192
  c.model.tie_embeddings = False
  c.model.init_std = 0.02
  c.model.scan_layers = True
  c.model.remat_policy = "minimal"
  c.model.param_dtype = "float32"
  # Compute dtype; "auto": bfloat16 on accelerators (GPU, TPU), float32 on CPU.
  c.model.dtype = "auto"

  c.attention = ml_collections.ConfigDict()
  # xla (reference einsums), pallas (our flash-attention kernels: GPU, TPU), cudnn (GPU), auto
  # (cudnn on GPU, pallas on TPU, xla on CPU).
  c.attention.impl = "xla"
  # pallas only: run the kernels in the Pallas interpreter (any backend, slow: for tests on CPU).
  c.attention.interpret = False
  # pallas only: query / key rows per kernel block; 0 picks the backend's default.
  c.attention.block_q = 0
  c.attention.block_k = 0

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1  # -1: all devices not used by the other axes
  c.mesh.tensor = 1
  # Multi-host: how many groups of hosts (TPU slices, else processes) the data and fsdp axes
  # span over the data-center network; each group holds mesh.data/dcn_data x
  # mesh.fsdp/dcn_fsdp x mesh.tensor devices linked by ICI/NVLink. 1 and 1 in a multi-process
  # run without slices: one flat mesh over all devices.
  c.mesh.dcn_data = 1
  c.mesh.dcn_fsdp = 1

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000
  c.train.global_batch_size = 8  # sequences per optimizer step, over all devices and microbatches
  c.train.seq_len = 1024
  c.train.grad_accum_steps = 1
  c.train.seed = 0
  c.train.log_every = 10
  c.train.eval_every = 200
  c.train.eval_batches = 4
  # Tokens per chunk of the cross-entropy; bounds the float32 logits temporary to [B, chunk, V].
  c.train.loss_chunk_size = 512
  # Steps with a NaN/Inf loss or gradient skip their update; this many in a row stop the run.
  c.train.max_consecutive_bad_steps = 10
  # A logged loss more than this many standard deviations above its running mean is reported
  # as a spike (console warning, `loss_spikes` in metrics.jsonl); 0 turns the check off.
  c.train.loss_spike_sigmas = 6.0
  # "lm": next-token cross-entropy on loss-mask tokens (pre-training, and SFT when data.format
  # marks the prompt out of the loss); "dpo": Direct Preference Optimization on preference
  # pairs (data.format="preference") against a frozen reference (see the dpo group).
  c.train.objective = "lm"

  c.dpo = ml_collections.ConfigDict()
  # Strength of the implicit KL penalty: larger keeps the policy nearer the reference.
  c.dpo.beta = 0.1

  # Low-rank adapters: rank 0 trains every weight (full fine-tuning); rank > 0 freezes the base
  # weights and trains only adapters W + (alpha / rank) * A @ B on lora.targets. Only the
  # adapters are in the optimizer state and in checkpoints; the base comes from
  # checkpoint.init_from (on every start and resume).
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0
  c.lora.alpha = 16.0
  c.lora.dropout = 0.0  # dropout on the adapter's input, training only
  c.lora.targets = "q,k,v,o,gate,up,down"  # comma-separated subset of LORA_TARGETS
  # Frozen base weights stored as "none" (param_dtype), "int8", "int4" or "nf4" (QLoRA),
  # dequantized layer by layer in the forward pass; needs lora.rank > 0.
  c.lora.quantize_base = "none"
  c.lora.quant_group_size = 64  # input-dim elements sharing one scale (int4/nf4/int8)

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 3e-4
  c.optim.warmup_steps = 100
  c.optim.decay_steps = config_dict.placeholder(int)  # None: train.steps
  c.optim.min_lr_ratio = 0.1
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1
  c.optim.grad_clip_norm = 1.0
  # dtype of the Adam moments (mu, nu); they are updated in float32 and stored in this dtype.
  c.optim.state_dtype = "float32"
  # Keep the optimizer state in pinned host memory between steps (it comes to the device for
  # the update): frees 2x the param bytes (float32 moments) of device memory per device.
  c.optim.offload_state = False

  c.data = ml_collections.ConfigDict()
  # "stdlib_bytes" (the demo corpus), "arrayrecord" (shards from `python -m
  # jaxtrain.data.prepare`), or raw "text" files, "jsonl", "parquet" tokenized while training.
  c.data.source = "stdlib_bytes"
  c.data.train_paths = ""  # glob(s), comma-separated; used by file-based sources
  c.data.eval_paths = ""  # empty: hold out data.eval_fraction of the training documents
  c.data.field = "text"  # JSONL field / Parquet column holding the document
  # JSONL records: "text" (field above), "prompt_completion" ({"prompt", "completion"}: loss on
  # the completion) or "chat" ({"messages": [...]}, the tokenizer's chat template: loss on the
  # assistant turns).
  c.data.format = "text"
  # Several sources sampled by weight: name -> {data.* keys to override, weight}. Define it in
  # a config file; override weights on the command line (--config.data.mixture.web.weight=0.7).
  c.data.mixture = ml_collections.ConfigDict()
  c.data.tokenizer = "byte"  # "byte", "hf:PATH/tokenizer.json", "sentencepiece:PATH.model"
  c.data.add_bos = False
  c.data.add_eos = True
  c.data.on_bad_record = "fail"  # JSONL: "fail" names file:line; "skip" drops and counts
  c.data.on_decode_error = "fail"  # text files: "fail" on invalid UTF-8, or "replace"
  c.data.eval_fraction = 0.02
  c.data.seed = 0
  c.data.num_workers = 0  # grain worker processes per data shard
  # Virtual data shards S: shard s reads the pieces (or documents) s::S and gives B/S rows of
  # every global batch of B, in shard order; each process reads only its own shards. A fixed S
  # makes the global batches the same for any process count dividing S, so a checkpoint
  # resumes exactly on another number of hosts (docs/launch.md). 0: one shard per process.
  c.data.num_shards = 0

  # Multi-process runs (jaxtrain/distributed.py); ignored by a single process.
  c.distributed = ml_collections.ConfigDict()
  # A process silent this long (died, hung, lost its network) stops every other process with
  # an error, instead of leaving them waiting in a collective.
  c.distributed.heartbeat_timeout_s = 60
  c.distributed.initialization_timeout_s = 300  # how long to wait for all processes to start
  c.distributed.shutdown_timeout_s = 300  # at the end, how long to wait for the slowest

  c.checkpoint = ml_collections.ConfigDict()
  # Save every N steps and at the end (0: no checkpoints). The same command with the same
  # --workdir then resumes from the latest complete checkpoint.
  c.checkpoint.every_steps = 0
  c.checkpoint.max_to_keep = 3  # 0: keep all
  c.checkpoint.keep_every = 0  # also keep every M-th step for good (0: none)
  c.checkpoint.directory = ""  # default WORKDIR/checkpoints; any path Orbax supports (gs://...)
  c.checkpoint.async_save = True
  # Initialize the params (only) from another run's checkpoint (a step directory, its
  # checkpoints/ directory or its workdir: the latest step) or from converted weights (a
  # directory with params/, e.g. from `python -m jaxtrain.interop.hf import`). The optimizer
  # starts fresh at step 0. Ignored when --workdir already has a checkpoint to resume from.
  c.checkpoint.init_from = ""

  c.log = ml_collections.ConfigDict()
  c.log.tensorboard = True
  return c


def llama3_config(*, num_layers: int, d_model: int, num_heads: int, head_dim: int, mlp_dim: int,
                  tie_embeddings: bool, rope_factor: float,
                  global_batch_size: int) -> ml_collections.ConfigDict:
  """What every published Llama 3.x size shares (vocab, 8 kv heads, RoPE theta and llama3
  scaling, norm eps), with training defaults for accelerators; configs/ give the dims."""
  c = default_config()
  m = c.model
  m.vocab_size, m.num_layers, m.d_model = 128256, num_layers, d_model
  m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = num_heads, 8, head_dim, mlp_dim
  m.tie_embeddings, m.norm_eps, m.rope_theta = tie_embeddings, 1e-5, 500000.0
  m.rope_scaling.type, m.rope_scaling.factor = "llama3", rope_factor
  m.rope_scaling.low_freq_factor, m.rope_scaling.high_freq_factor = 1.0, 4.0
  m.rope_scaling.original_max_position_embeddings = 8192
  m.max_position_embeddings = 131072
  m.scan_layers, m.remat_policy = True, "minimal"
  m.param_dtype, m.dtype = "float32", "auto"
  c.attention.impl = "auto"
  c.train.global_batch_size, c.train.seq_len, c.train.steps = global_batch_size, 8192, 10000
  c.train.loss_chunk_size = 1024
  c.optim.learning_rate, c.optim.warmup_steps = 3e-4, 1000
  return c


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file (what `--config=PATH` loads), for scripts and tests."""
  name = "jaxtrain_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@dataclasses.dataclass(frozen=True)
class MeshShape:
  data: int
  fsdp: int
  tensor: int

  @property
  def batch_shards(self) -> int:
    return self.data * self.fsdp


def resolve_mesh_shape(config, num_devices: int) -> MeshShape:
  """Fills the one -1 axis so the product is the device count; ConfigError when impossible."""
  sizes = {name: int(config.mesh[name]) for name in ("data", "fsdp", "tensor")}
  free = [n for n, s in sizes.items() if s == -1]
  for name, size in sizes.items():
    if size == 0 or size < -1:
      raise ConfigError(f"mesh.{name}={size}: mesh axis sizes must be positive (or -1 for one axis "
                        f"to take the remaining devices)")
  if len(free) > 1:
    raise ConfigError(f"mesh.{free[1]}=-1: only one mesh axis may be -1 (also mesh.{free[0]}=-1); "
                      f"give the others explicit sizes")
  fixed = 1
  for n, s in sizes.items():
    if s != -1:
      fixed *= s
  if free:
    if num_devices % fixed:
      given = " ".join(f"mesh.{n}={s}" for n, s in sizes.items())
      raise ConfigError(f"{given}: the fixed axes multiply to {fixed}, which does not divide the "
                        f"{num_devices} devices, so mesh.{free[0]}=-1 cannot fill them; choose "
                        f"sizes whose product divides {num_devices}")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(f"mesh.data*mesh.fsdp*mesh.tensor={sizes['data']}*{sizes['fsdp']}*"
                      f"{sizes['tensor']}={fixed}, but {num_devices} devices are present; make "
                      f"the product {num_devices} or set one axis to -1")
  return MeshShape(**sizes)


def _positive(config, key: str):
  node = config
  for part in key.split("."):
    node = node[part]
  if node is None or node <= 0:
    raise ConfigError(f"{key}={node}: must be a positive number")


def validate(config, num_devices: int, platform: str = "cpu", *,
             num_processes: int | None = None, num_slices: int = 1) -> MeshShape:
  """Checks everything that can be checked before compiling. Returns the resolved mesh shape.

  `platform` is the JAX backend ("cpu", "gpu", "tpu") for backend-specific choices.
  `num_processes` and `num_slices` (TPU slices) are the run's hosts, for the multi-host keys;
  None (dry runs, which emulate devices in one process) skips the checks against them.

  Raises ConfigError with one line: the key, the bad value, and how to fix it.
  """
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
  if config.optim.state_dtype not in STATE_DTYPES:
    raise ConfigError(f"optim.state_dtype={config.optim.state_dtype!r}: choose one of "
                      f"{', '.join(STATE_DTYPES)}")
  _check_host_memory(config, platform)
  _check_finetuning(config)
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(f"model.num_kv_heads={m.num_kv_heads}: must divide model.num_heads="
                      f"{m.num_heads} (grouped-query attention); pick a divisor of it")
  if m.head_dim % 2:
    raise ConfigError(f"model.head_dim={m.head_dim}: must be even for rotary embeddings")

  mesh = resolve_mesh_shape(config, num_devices)
  tensor_divides = (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads),
                    ("model.mlp_dim", m.mlp_dim), ("model.vocab_size", m.vocab_size))
  for key, value in tensor_divides:
    if value % mesh.tensor:
      raise ConfigError(f"mesh.tensor={mesh.tensor}: does not divide {key}={value}; use a "
                        f"tensor size that divides it (e.g. "
                        f"{_largest_divisor(value, mesh.tensor)})")
  if m.d_model % mesh.fsdp:
    raise ConfigError(f"mesh.fsdp={mesh.fsdp}: does not divide model.d_model={m.d_model}; use an "
                      f"fsdp size that divides it")

  t = config.train
  per_step = mesh.batch_shards * t.grad_accum_steps
  if t.global_batch_size % per_step:
    raise ConfigError(
        f"train.global_batch_size={t.global_batch_size}: must be divisible by mesh.data*mesh.fsdp"
        f"*train.grad_accum_steps={mesh.data}*{mesh.fsdp}*{t.grad_accum_steps}={per_step}; use a "
        f"multiple of {per_step}")
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
  for key in ("every_steps", "max_to_keep", "keep_every"):
    if config.checkpoint[key] < 0:
      raise ConfigError(f"checkpoint.{key}={config.checkpoint[key]}: must be >= 0")
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
  _check_multihost(config, mesh, num_processes, num_slices)
  return mesh


def _check_multihost(config, mesh: MeshShape, num_processes: int | None, num_slices: int):
  """mesh.dcn_*, data.num_shards and distributed.* (see default_config)."""
  dcn = {}
  for axis in ("data", "fsdp"):
    size, whole = config.mesh[f"dcn_{axis}"], getattr(mesh, axis)
    if not isinstance(size, int) or size < 1:
      raise ConfigError(f"mesh.dcn_{axis}={size}: must be a positive number of host groups (1: "
                        f"the {axis} axis stays within each host or slice)")
    if whole % size:
      raise ConfigError(f"mesh.dcn_{axis}={size}: does not divide mesh.{axis}={whole}; the "
                        f"{axis} axis is split into {size} groups across hosts, so make "
                        f"mesh.{axis} a multiple of {size}, e.g. --config.mesh.{axis}={size}")
    dcn[axis] = size
  product = dcn["data"] * dcn["fsdp"]
  if num_processes is not None and (product > 1 or num_slices > 1):
    groups, what = (num_slices, "TPU slices") if num_slices > 1 else (num_processes, "processes")
    if groups == 1:
      raise ConfigError(f"mesh.dcn_data*mesh.dcn_fsdp={dcn['data']}*{dcn['fsdp']}={product}: "
                        f"this run is a single process, with no other hosts to span; set "
                        f"mesh.dcn_data=1 and mesh.dcn_fsdp=1 (for multi-process runs)")
    if product != groups:
      flat = "" if num_slices > 1 else ", or 1*1 for one flat mesh over all devices"
      raise ConfigError(f"mesh.dcn_data*mesh.dcn_fsdp={dcn['data']}*{dcn['fsdp']}={product}, but "
                        f"this run has {groups} {what}; make the product {groups} (e.g. "
                        f"--config.mesh.dcn_data={groups} with mesh.data a multiple of it){flat}")
  batch, shards = config.train.global_batch_size, config.data.num_shards
  if not isinstance(shards, int) or shards < 0:
    raise ConfigError(f"data.num_shards={shards}: must be >= 0 (0: one shard per process)")
  if shards and batch % shards:
    raise ConfigError(f"data.num_shards={shards}: must divide train.global_batch_size={batch} "
                      f"(each shard gives global_batch_size/num_shards rows of every batch); "
                      f"e.g. {_largest_divisor(batch, shards)}")
  if num_processes is not None and num_processes > 1:
    if shards and shards % num_processes:
      raise ConfigError(f"data.num_shards={shards}: must be a multiple of the {num_processes} "
                        f"processes, so each reads whole shards; e.g. {num_processes} or "
                        f"{2 * num_processes}")
    if not shards and batch % num_processes:
      raise ConfigError(f"train.global_batch_size={batch}: must be divisible by the "
                        f"{num_processes} processes (data.num_shards=0: one shard per process); "
                        f"use a multiple of {num_processes}")
  check_distributed(config)


def check_distributed(config):
  """distributed.*: checked by validate() and, before JAX starts, by the CLI."""
  for key in ("heartbeat_timeout_s", "initialization_timeout_s", "shutdown_timeout_s"):
    value = config.distributed[key]
    if not isinstance(value, (int, float)) or value < 1:
      raise ConfigError(f"distributed.{key}={value}: must be at least 1 (seconds)")


def lora_targets(config) -> tuple[str, ...]:
  """lora.targets as a tuple of names from LORA_TARGETS, in their canonical order."""
  names = {n.strip() for n in config.lora.targets.split(",") if n.strip()}
  return tuple(n for n in LORA_TARGETS if n in names)


def _check_finetuning(config):
  """train.objective, dpo.* and lora.* keys."""
  objective = config.train.objective
  if objective not in OBJECTIVES:
    raise ConfigError(f"train.objective={objective!r}: choose one of {', '.join(OBJECTIVES)}")
  if objective == "dpo":
    if config.dpo.beta <= 0:
      raise ConfigError(f"dpo.beta={config.dpo.beta}: must be positive (typical: 0.1)")
    if config.data.format != "preference":
      raise ConfigError(f"train.objective='dpo' with data.format={config.data.format!r}: DPO "
                        f"trains on preference pairs; set data.format='preference' with JSONL "
                        f"records {{prompt, chosen, rejected}}")
  elif config.data.format == "preference":
    raise ConfigError("data.format='preference': preference pairs train only with "
                      "train.objective='dpo'")
  lora = config.lora
  if lora.rank < 0:
    raise ConfigError(f"lora.rank={lora.rank}: must be >= 0 (0: full fine-tuning)")
  if lora.rank == 0 and lora.quantize_base != "none":
    # (The model config of a rank-0 run carries no LoRA fields, so the model's check below
    # cannot see this one.)
    raise ConfigError(f"lora.quantize_base={lora.quantize_base!r} with lora.rank=0: a "
                      f"quantized base is frozen, so only adapters could train; set lora.rank "
                      f"(e.g. 16) or lora.quantize_base='none'")
  if lora.rank > 0:
    # Only here are the targets still a string: names the model config would drop.
    unknown = [n.strip() for n in lora.targets.split(",")
               if n.strip() and n.strip() not in LORA_TARGETS]
    if unknown:
      raise ConfigError(f"lora.targets={lora.targets!r}: unknown "
                        f"{', '.join(map(repr, unknown))}; give a comma-separated subset of "
                        f"{','.join(LORA_TARGETS)}")
    if lora.alpha <= 0:
      raise ConfigError(f"lora.alpha={lora.alpha}: must be positive (the adapter scale is "
                        f"alpha / rank)")
    if not 0.0 <= lora.dropout < 1.0:
      raise ConfigError(f"lora.dropout={lora.dropout}: must be in [0, 1)")
  # The model's own check of its LoRA/QLoRA fields (rank, quantization, targets, group size
  # against the projections' input sizes), so a bad value stops here, before anything compiles.
  from jaxtrain.model import ModelConfig  # pylint: disable=import-outside-toplevel  (cycle)
  from jaxtrain.peft import check_config  # pylint: disable=import-outside-toplevel
  try:
    check_config(ModelConfig.from_config(config, platform="cpu"))
  except ValueError as e:
    raise ConfigError(str(e)) from None


def resolve_compute_dtype(name: str, platform: str) -> str:
  """`model.dtype` as a dtype name: "auto" is bfloat16 on accelerators, float32 on CPU."""
  if name != "auto":
    return name
  return "float32" if platform == "cpu" else "bfloat16"


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


def _largest_divisor(value: int, limit: int) -> int:
  return max(d for d in range(1, limit + 1) if value % d == 0)
