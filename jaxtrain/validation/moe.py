"""Validation of the Mixture-of-Experts settings (the moe group, mesh.expert), of latent
attention's dims and of multi-token prediction: DeepSeek-V3's parts of config_checks.validate,
one ConfigError line each."""

from __future__ import annotations

from jaxtrain.config import ConfigError
from jaxtrain.models import registry
from jaxtrain.models.config import architecture_of, parse_layer_indices
from jaxtrain.models.decoder import check_layer_kinds
from jaxtrain.ops.grouped_matmul import IMPLS as GROUPED_MATMUL_IMPLS
from jaxtrain.parallel.mesh import MeshShape

ROUTER_SCORES = ("softmax", "sigmoid")


def check_moe(config, mesh: MeshShape):
  """The moe group, and mesh.expert, against the model."""
  moe, m = config.moe, config.model
  if moe.num_experts < 0:
    raise ConfigError(f"moe.num_experts={moe.num_experts}: must be >= 0 (0: a dense model)")
  family = registry.get(m.family)
  moe_families = ", ".join(n for n, f in registry.FAMILIES.items() if f.hf_experts)
  if family.hf_experts and not moe.num_experts:
    raise ConfigError(f"model.family={m.family!r}: a Mixture-of-Experts family needs "
                      f"moe.num_experts > 0 (and moe.experts_per_token, moe.expert_mlp_dim)")
  if moe.num_experts and not family.hf_experts:
    raise ConfigError(f"model.family={m.family!r}: has no Mixture-of-Experts layers "
                      f"(moe.num_experts={moe.num_experts}); use a family that has them: "
                      f"{moe_families}")
  if not moe.num_experts:
    if mesh.expert > 1:
      raise ConfigError(f"mesh.expert={mesh.expert}: the model has no MoE layers "
                        f"(moe.num_experts=0) to split; use mesh.data or mesh.fsdp for these "
                        f"devices")
    return
  if not 1 <= moe.experts_per_token <= moe.num_experts:
    raise ConfigError(f"moe.experts_per_token={moe.experts_per_token}: must be between 1 and "
                      f"moe.num_experts={moe.num_experts}")
  if moe.expert_mlp_dim < 0:
    raise ConfigError(f"moe.expert_mlp_dim={moe.expert_mlp_dim}: must be >= 0 (0: model."
                      f"mlp_dim)")
  if moe.capacity_factor < 0:
    raise ConfigError(f"moe.capacity_factor={moe.capacity_factor}: must be >= 0 (0: dropless; "
                      f"> 0: each expert takes at most that multiple of its even share)")
  for key in ("aux_loss_coef", "router_z_loss_coef", "seq_aux_loss_coef"):
    if moe[key] < 0:
      raise ConfigError(f"moe.{key}={moe[key]}: must be >= 0 (0: off)")
  _check_deepseek_routing(moe)
  if moe.sparse_step < 1:
    raise ConfigError(f"moe.sparse_step={moe.sparse_step}: must be >= 1 (1: every layer MoE)")
  if moe.grouped_matmul not in GROUPED_MATMUL_IMPLS:
    raise ConfigError(f"moe.grouped_matmul={moe.grouped_matmul!r}: choose one of "
                      f"{', '.join(GROUPED_MATMUL_IMPLS)}")
  try:
    dense = parse_layer_indices(moe.dense_layers)
  except ValueError:
    raise ConfigError(f"moe.dense_layers={moe.dense_layers!r}: give comma-separated layer "
                      f"indices, e.g. '0,1,2'") from None
  if any(not 0 <= i < m.num_layers for i in dense):
    raise ConfigError(f"moe.dense_layers={moe.dense_layers!r}: indices must be in 0.."
                      f"{m.num_layers - 1} (model.num_layers={m.num_layers})")
  arch = architecture_of(config)
  if not any(arch.moe_layers()):
    raise ConfigError(f"moe.dense_layers / moe.sparse_step leave no MoE layer of "
                      f"model.num_layers={m.num_layers}; set moe.num_experts=0 for a dense model")
  if m.scan_layers:
    try:
      check_layer_kinds(arch)
    except ValueError as e:
      raise ConfigError(f"moe.dense_layers={moe.dense_layers!r}: {e}") from None
  if mesh.stage > 1:
    raise ConfigError(f"mesh.stage={mesh.stage}: pipeline stages of MoE layers are not "
                      f"supported yet (their router statistics would have to cross the "
                      f"stages); use mesh.expert and mesh.fsdp for these devices")


def _check_deepseek_routing(moe):
  """DeepSeek-V3's router settings (models/moe.route) and its bias balancing."""
  if moe.router_score not in ROUTER_SCORES:
    raise ConfigError(f"moe.router_score={moe.router_score!r}: choose one of "
                      f"{', '.join(ROUTER_SCORES)}")
  if moe.n_group < 1 or moe.num_experts % moe.n_group:
    raise ConfigError(f"moe.n_group={moe.n_group}: must divide moe.num_experts="
                      f"{moe.num_experts} into equal groups (1: no groups)")
  if not 1 <= moe.topk_group <= moe.n_group:
    raise ConfigError(f"moe.topk_group={moe.topk_group}: must be between 1 and moe.n_group="
                      f"{moe.n_group} (the groups a token's experts may come from)")
  eligible = moe.topk_group * (moe.num_experts // moe.n_group)
  if moe.experts_per_token > eligible:
    raise ConfigError(f"moe.experts_per_token={moe.experts_per_token}: more than the "
                      f"{eligible} experts of moe.topk_group={moe.topk_group} groups of "
                      f"{moe.num_experts // moe.n_group}; raise moe.topk_group")
  if moe.routed_scaling_factor <= 0:
    raise ConfigError(f"moe.routed_scaling_factor={moe.routed_scaling_factor}: must be "
                      f"positive (1: the routing weights as they are)")
  if moe.num_shared_experts < 0:
    raise ConfigError(f"moe.num_shared_experts={moe.num_shared_experts}: must be >= 0")
  if moe.bias_update_rate < 0:
    raise ConfigError(f"moe.bias_update_rate={moe.bias_update_rate}: must be >= 0 (0: the "
                      f"router biases stay as they are; DeepSeek-V3 used 0.001)")


def check_latent_attention(config):
  """Multi-head latent attention's dims (models/mla.py), when model.kv_lora_rank > 0."""
  m = config.model
  for key in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
    if m[key] < 0:
      raise ConfigError(f"model.{key}={m[key]}: must be >= 0")
  if not m.kv_lora_rank:
    given = [k for k in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim") if m[k]]
    if given:
      raise ConfigError(f"model.{given[0]}={m[given[0]]}: a latent attention setting, but "
                        f"model.kv_lora_rank=0 (no latent); set model.kv_lora_rank")
    return
  if not 0 < m.qk_rope_head_dim < m.head_dim or m.qk_rope_head_dim % 2:
    raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim}: must be even and between "
                      f"0 and model.head_dim={m.head_dim} (the query/key dims RoPE turns)")
  if not 0 < m.v_head_dim <= m.head_dim:
    raise ConfigError(f"model.v_head_dim={m.v_head_dim}: must be between 1 and model.head_dim="
                      f"{m.head_dim} (the values' head dim)")
  if m.num_kv_heads != m.num_heads:
    raise ConfigError(f"model.num_kv_heads={m.num_kv_heads}: latent attention gives every head "
                      f"its own keys and values; set it to model.num_heads={m.num_heads}")
  if m.sliding_window:
    raise ConfigError(f"model.sliding_window={m.sliding_window}: sliding-window layers with "
                      f"latent attention (model.kv_lora_rank={m.kv_lora_rank}) are not "
                      f"supported; set model.sliding_window=0")


def check_multi_token_prediction(config, mesh: MeshShape):
  """model.mtp_depth / mtp_loss_weight (models/mtp.py) against the family, objective and mesh."""
  m = config.model
  if m.mtp_depth < 0:
    raise ConfigError(f"model.mtp_depth={m.mtp_depth}: must be >= 0 (0: no multi-token "
                      f"prediction)")
  if m.mtp_loss_weight < 0:
    raise ConfigError(f"model.mtp_loss_weight={m.mtp_loss_weight}: must be >= 0")
  if not m.mtp_depth:
    return
  family = registry.get(m.family)
  if not family.multi_token_prediction:
    with_mtp = ", ".join(n for n, f in registry.FAMILIES.items() if f.multi_token_prediction)
    raise ConfigError(f"model.mtp_depth={m.mtp_depth}: model.family={m.family!r} has no "
                      f"multi-token prediction; set model.mtp_depth=0, or use {with_mtp}")
  if config.train.objective != "lm":
    raise ConfigError(f"model.mtp_depth={m.mtp_depth}: multi-token prediction trains with the "
                      f"language-model objective, not train.objective="
                      f"{config.train.objective!r}; set model.mtp_depth=0")
  if mesh.context > 1:
    raise ConfigError(f"model.mtp_depth={m.mtp_depth}: multi-token prediction under context "
                      f"parallelism (mesh.context={mesh.context}) is not supported (its inputs "
                      f"shift along the split sequence); use mesh.context=1")
