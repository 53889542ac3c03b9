"""The model's config, in four parts: what the architecture is (what a config.json says), how it
runs (dtypes, remat, kernels), how it is parallelized, and its adapters (LoRA / QLoRA).

`ModelConfig.from_config(run_config)` builds it from the ml-collections run config (its `model`,
`attention`, `pipeline` and `lora` groups); `ModelConfig.of(**fields)` and `cfg.replace(**fields)`
take any part's field by name, for tests and scripts:

    cfg = ModelConfig.of(family="qwen3", vocab_size=128, num_layers=2, d_model=64, num_heads=4,
                         num_kv_heads=2, head_dim=32, mlp_dim=128)
    cfg.arch.d_model, cfg.runtime.dtype, cfg.replace(scan_layers=False)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxtrain.config import default_config, lora_targets, resolve_compute_dtype
from jaxtrain.models import registry
from jaxtrain.models.features import Features
from jaxtrain.models.rope import YARN_KEYS
from jaxtrain.parallel.mesh import platform_of_backend

FULL, SLIDING = "full", "sliding"
LAYER_TYPES = (FULL, SLIDING)


@dataclasses.dataclass(frozen=True)
class Architecture:
  """What the model computes: the numbers of its config.json and its family's switches."""
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  family: str = "llama"
  norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  # Frequency scaling of the (global layers') RoPE, hashable: (("type", "llama3"), ("factor",
  # 8.0), ...) or (("type", "linear"), ("factor", 8.0)); None: plain RoPE.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  max_position_embeddings: int = 8192
  tie_embeddings: bool = False
  # A scalar score head instead of the vocabulary head (a reward model).
  score_head: bool = False
  # A scalar value head beside the vocabulary head (PPO's critic on the policy's trunk).
  value_head: bool = False
  init_std: float = 0.02
  # Sliding-window attention: a token sees the `sliding_window` tokens ending at itself on the
  # layers whose type is "sliding"; 0: no window anywhere.
  sliding_window: int = 0
  # Per layer "full" or "sliding"; empty: every layer sliding when sliding_window > 0, else full.
  layer_types: tuple[str, ...] = ()
  # RoPE base of the sliding layers (plain RoPE, no scaling); 0: the same RoPE as the others.
  local_rope_theta: float = 0.0
  # The softmax scale is query_pre_attn_scalar ** -0.5; 0: head_dim ** -0.5.
  query_pre_attn_scalar: float = 0.0
  # Mixture of Experts (models/moe.py): num_experts > 0 gives the MoE layers num_experts gated
  # MLPs of expert_mlp_dim (0: mlp_dim), experts_per_token of them per token. A layer is MoE
  # unless listed in dense_layers, when (i + 1) is a multiple of sparse_step.
  num_experts: int = 0
  experts_per_token: int = 2
  expert_mlp_dim: int = 0
  norm_topk_prob: bool = True
  dense_layers: tuple[int, ...] = ()
  sparse_step: int = 1
  # DeepSeek-V3's routing (models/moe.route): sigmoid or softmax scores, a correction bias that
  # chooses experts, group-limited choice, a scale on the weights, and always-on shared experts.
  router_score: str = "softmax"
  router_bias: bool = False
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  num_shared_experts: int = 0
  # Multi-head latent attention (models/mla.py) when kv_lora_rank > 0; head_dim is then the
  # query/key head dim (its last qk_rope_head_dim dims turned by RoPE), v_head_dim the values'.
  q_lora_rank: int = 0
  kv_lora_rank: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # Multi-token prediction modules after the layers (models/mtp.py; DeepSeek-V3: 1).
  mtp_depth: int = 0

  @property
  def features(self) -> Features:
    return registry.get(self.family).features

  def sliding_layers(self) -> tuple[bool, ...]:
    """Whether each layer attends within the sliding window."""
    if not self.sliding_window:
      return (False,) * self.num_layers
    if not self.layer_types:
      return (True,) * self.num_layers
    return tuple(t == SLIDING for t in self.layer_types)

  def moe_layers(self) -> tuple[bool, ...]:
    """Whether each layer's feed-forward block is the MoE one."""
    return tuple(bool(self.num_experts) and i not in self.dense_layers
                 and (i + 1) % self.sparse_step == 0 for i in range(self.num_layers))

  @property
  def expert_dim(self) -> int:
    """Each expert's hidden size."""
    return self.expert_mlp_dim or self.mlp_dim

  @property
  def sm_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def describe(self) -> str:
    """One line for run tables: family, sizes, and the window where there is one."""
    out = (f"{self.family}: L={self.num_layers} D={self.d_model} H={self.num_heads} "
           f"K={self.num_kv_heads} E={self.head_dim} F={self.mlp_dim} V={self.vocab_size}")
    if self.kv_lora_rank:
      out += (f", latent attention (kv latent {self.kv_lora_rank}, query rank "
              f"{self.q_lora_rank or 'full'}, RoPE on {self.qk_rope_head_dim} of E, values "
              f"{self.v_head_dim})")
    if self.mtp_depth:
      out += f", {self.mtp_depth} multi-token prediction module(s)"
    if self.score_head:
      out += ", score head (reward model)"
    if self.value_head:
      out += ", value head (PPO)"
    sliding = sum(self.sliding_layers())
    if sliding:
      out += f", window {self.sliding_window} on {sliding} of {self.num_layers} layers"
    moe = sum(self.moe_layers())
    if moe:
      out += (f", {self.num_experts} experts of F={self.expert_dim} (top {self.experts_per_token})"
              f" on {moe} of {self.num_layers} layers")
    return out


@dataclasses.dataclass(frozen=True)
class Runtime:
  """How the model computes: dtypes, the layer loop and remat, the attention kernel."""
  scan_layers: bool = True
  remat_policy: str = "minimal"
  attention_impl: str = "xla"
  attention_interpret: bool = False  # pallas: run the kernels in the Pallas interpreter
  attention_blocks: tuple[int, int] = (0, 0)  # pallas: (block_q, block_k); 0 = the default
  param_dtype: str = "float32"
  dtype: str = "float32"
  # Weight gradients of the projections and the head from an explicitly transposed input
  # (peft.projection.dense): faster GEMMs on XLA:CPU. from_config sets it for the CPU platform
  # only; on accelerators XLA picks operand layouts itself.
  explicit_transpose_for_dw: bool = False
  # The projections' and MLP matmuls: "none" (the compute dtype) or "fp8" (jaxtrain/ops/fp8.py).
  matmul_precision: str = "none"
  fp8_head: bool = False  # the loss's head matmuls in FP8 too (cross_entropy.py)
  # MoE layers: capacity factor (0: dropless), the grouped matmul's route (grouped_matmul.py),
  # and the weights of the router's auxiliary losses in the objective.
  moe_capacity_factor: float = 0.0
  moe_grouped_matmul: str = "auto"
  moe_aux_loss_coef: float = 0.0
  moe_z_loss_coef: float = 0.0
  moe_seq_aux_loss_coef: float = 0.0
  moe_bias_update_rate: float = 0.0  # router correction biases' balancing step (train_step)
  mtp_loss_weight: float = 0.0  # the multi-token-prediction losses' weight (train_step)
  # Each attention layer reports its heads' largest logits (ops/max_logit.py): for QK-clip
  # (optim.muon.qk_clip_threshold) and the attn_max_logit metric (optim.log_max_logit).
  track_max_logit: bool = False
  # What the model compiles for ("cpu", "gpu", "tpu"): it picks the attention kernel's route.
  # The mesh's devices decide it (train_setup.build), not the process's default backend, so a
  # CPU process compiles the GPU or TPU program for a deviceless target.
  platform: str = "cpu"


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """How the layers and the sequence are split when the mesh asks for it (jaxtrain/parallel)."""
  # Under a mesh with a `context` axis > 1: how attention crosses the split sequence, and
  # whether the sequence is in the load-balanced layout.
  context_parallel: str = "all_gather"
  context_load_balance: bool = True
  # Under a mesh with a `stage` axis > 1: microbatches per pass (0: as many as stages),
  # circular repeats, and whether FSDP gathers a stage's weights once per step.
  pipeline_microbatches: int = 0
  pipeline_repeats: int = 1
  pipeline_gather_weights_once: bool = False


@dataclasses.dataclass(frozen=True)
class Adapters:
  """LoRA / QLoRA (the run config's `lora` group; rank 0 = the plain model, bit for bit)."""
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_dropout: float = 0.0  # on the adapters' inputs, only when a dropout key is given
  lora_targets: tuple[str, ...] = ()  # subset of the family's lora_targets
  base_quant: str = "none"  # "none" | "int8" | "int4" | "nf4": storage of the frozen projections
  quant_group_size: int = 64  # input elements per quantization scale


_PARTS = {"arch": Architecture, "runtime": Runtime, "parallel": Parallelism, "peft": Adapters}
_OWNER = {f.name: part for part, cls in _PARTS.items() for f in dataclasses.fields(cls)}


def _by_part(fields: dict) -> dict[str, dict]:
  """Fields named without their part, sorted into {part: {name: value}}."""
  parts = {part: {} for part in _PARTS}
  for name, value in fields.items():
    if name not in _OWNER:
      raise TypeError(f"ModelConfig has no field {name!r}")
    parts[_OWNER[name]][name] = value
  return parts


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: Architecture
  runtime: Runtime = Runtime()
  parallel: Parallelism = Parallelism()
  peft: Adapters = Adapters()

  @classmethod
  def of(cls, **fields) -> "ModelConfig":
    """A config from fields of any part, by name (the architecture's are required)."""
    return cls(**{part: _PARTS[part](**values) for part, values in _by_part(fields).items()})

  def replace(self, **fields) -> "ModelConfig":
    """This config with fields of any part replaced, by name."""
    return dataclasses.replace(self, **{
        part: dataclasses.replace(getattr(self, part), **values)
        for part, values in _by_part(fields).items() if values})

  @classmethod
  def from_config(cls, config, platform: str | None = None) -> "ModelConfig":
    """From the ml-collections run config (its `model`, `attention`, `pipeline`, `lora` groups).

    `platform` ("cpu", "gpu", "tpu"; default: this process's JAX backend) is what the model
    compiles for: it resolves `model.dtype="auto"` (bfloat16 compute on accelerators, float32 on
    CPU) and the attention kernel's route.
    """
    m, a, p = config.model, config.attention, config.pipeline
    # A config saved before the moe group existed (a run's checkpoint metadata): a dense model.
    moe = config.moe if "moe" in config else default_config().moe
    platform = platform_of_backend(platform or jax.default_backend())
    peft = Adapters()
    # Rank 0 maps to the default fields, so a plain run config gives the plain ModelConfig.
    if "lora" in config and config.lora.rank > 0:
      peft = Adapters(lora_rank=config.lora.rank, lora_alpha=float(config.lora.alpha),
                      lora_dropout=float(config.lora.dropout),
                      lora_targets=lora_targets(config), base_quant=config.lora.quantize_base,
                      quant_group_size=config.lora.quant_group_size)
    runtime = Runtime(scan_layers=m.scan_layers, remat_policy=m.remat_policy,
                      attention_impl=a.impl, attention_interpret=a.interpret,
                      attention_blocks=(a.block_q, a.block_k), param_dtype=m.param_dtype,
                      dtype=resolve_compute_dtype(m.dtype, platform),
                      explicit_transpose_for_dw=platform == "cpu", platform=platform,
                      matmul_precision=(config.precision.matmul if "precision" in config
                                        else "none"),
                      fp8_head=bool(config.precision.get("fp8_head", False)
                                    if "precision" in config else False),
                      moe_capacity_factor=float(moe.capacity_factor),
                      moe_grouped_matmul=moe.grouped_matmul,
                      moe_aux_loss_coef=float(moe.aux_loss_coef),
                      moe_z_loss_coef=float(moe.router_z_loss_coef),
                      moe_seq_aux_loss_coef=float(moe.get("seq_aux_loss_coef", 0.0)),
                      moe_bias_update_rate=float(moe.get("bias_update_rate", 0.0)),
                      mtp_loss_weight=float(m.get("mtp_loss_weight", 0.0)),
                      track_max_logit=tracks_max_logit(config))
    parallel = Parallelism(context_parallel=a.context_parallel,
                           context_load_balance=bool(a.load_balance),
                           pipeline_microbatches=p.microbatches, pipeline_repeats=p.repeats,
                           pipeline_gather_weights_once=p.gather_weights_once)
    return cls(arch=architecture_of(config), runtime=runtime, parallel=parallel, peft=peft)


def qk_clip_threshold(config) -> float:
  """optim.muon.qk_clip_threshold of a run config with Muon (0: off, also for AdamW runs and
  configs saved before the key existed)."""
  o = config.get("optim")
  if o is None or o.get("name", "adamw") != "muon" or "muon" not in o:
    return 0.0
  return float(o.muon.get("qk_clip_threshold", 0.0))


def tracks_max_logit(config) -> bool:
  """Whether the model reports its attention's largest logits: for QK-clip, or as a metric."""
  o = config.get("optim")
  return qk_clip_threshold(config) > 0 or bool(o is not None and o.get("log_max_logit", False))


def rope_scaling_of(model_group) -> tuple[tuple[str, Any], ...] | None:
  """config.model.rope_scaling as the hashable tuple Architecture keeps (None for "none")."""
  rs = model_group.rope_scaling
  if rs.type == "llama3":
    keys = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings")
  elif rs.type == "linear":
    keys = ("factor",)
  elif rs.type == "yarn":
    keys = YARN_KEYS
  else:
    return None
  return (("type", rs.type),) + tuple((k, rs[k]) for k in keys)


def parse_layer_types(value: str) -> tuple[str, ...]:
  """config.model.layer_types ("full,sliding,...", or "") as a tuple."""
  return tuple(t.strip() for t in value.split(",") if t.strip())


def parse_layer_indices(value: str) -> tuple[int, ...]:
  """config.moe.dense_layers ("0,1,2", or "") as a tuple of ints."""
  return tuple(int(i.strip()) for i in str(value).split(",") if i.strip())


def _has_score_head(config) -> bool:
  """model.score_head, implied by train.objective="reward" (absent from older configs)."""
  train = config.get("train")
  return (bool(config.model.get("score_head", False))
          or (train is not None and train.get("objective") == "reward"))


def _has_value_head(config) -> bool:
  """model.value_head (absent from older configs)."""
  return bool(config.model.get("value_head", False))


def architecture_of(config) -> Architecture:
  """The Architecture of a run config: its `model` group, and its `moe` group when
  moe.num_experts > 0."""
  m, moe_group = config.model, config.get("moe")
  moe = {}
  if moe_group is not None and moe_group.num_experts:
    moe = dict(num_experts=int(moe_group.num_experts),
               experts_per_token=int(moe_group.experts_per_token),
               expert_mlp_dim=int(moe_group.expert_mlp_dim),
               norm_topk_prob=bool(moe_group.norm_topk_prob),
               dense_layers=parse_layer_indices(moe_group.dense_layers),
               sparse_step=int(moe_group.sparse_step))
    # Absent from configs saved before DeepSeek's routing existed: the softmax router.
    for key, kind in (("router_score", str), ("router_bias", bool), ("n_group", int),
                      ("topk_group", int), ("routed_scaling_factor", float),
                      ("num_shared_experts", int)):
      if key in moe_group:
        moe[key] = kind(moe_group[key])
  mla = {key: int(m[key]) for key in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                      "v_head_dim", "mtp_depth") if key in m}
  return Architecture(**moe, **mla,
      family=m.family, vocab_size=m.vocab_size, num_layers=m.num_layers, d_model=m.d_model,
      num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
      mlp_dim=m.mlp_dim, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
      rope_scaling=rope_scaling_of(m), max_position_embeddings=m.max_position_embeddings,
      tie_embeddings=m.tie_embeddings, init_std=m.init_std, score_head=_has_score_head(config),
      value_head=_has_value_head(config),
      sliding_window=int(m.sliding_window), layer_types=parse_layer_types(m.layer_types),
      local_rope_theta=float(m.local_rope_theta),
      query_pre_attn_scalar=float(m.query_pre_attn_scalar))
