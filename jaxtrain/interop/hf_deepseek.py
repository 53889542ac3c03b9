"""DeepSeek-V3's config.json fields <-> model.* and moe.*: latent attention's dims and the
DeepSeek router, in both directions (hf_config.py and hf_export_config.py call these for the
deepseek_v3 family; Kimi K2's config.json is the same model_type).

Refused, one line each: a rope_interleave of false (our import permutes the interleaved RoPE
columns, hf_weights), routing other than the sigmoid "noaux_tc" router, `topk_group` above
`n_group`, experts that `n_group` does not divide.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxtrain.interop.hf_errors import HFFormatError


def latent_attention_overrides(hf: dict, get: Callable[[str], Any],
                               heads: int) -> dict[str, Any]:
  """model.* of multi-head latent attention: head_dim is the query/key head (no-RoPE part plus
  RoPE part); every head its own keys and values (num_kv_heads = num_heads)."""
  rope, nope = int(get("qk_rope_head_dim")), int(get("qk_nope_head_dim"))
  value, kv_rank = int(get("v_head_dim")), int(get("kv_lora_rank"))
  # null (not absent): one query projection, no bottleneck.
  q_rank = int(hf["q_lora_rank"] or 0) if "q_lora_rank" in hf else int(get("q_lora_rank"))
  for key, size in (("qk_rope_head_dim", rope), ("qk_nope_head_dim", nope),
                    ("v_head_dim", value), ("kv_lora_rank", kv_rank)):
    if size <= 0:
      raise HFFormatError(f"config.json {key}={size}: must be positive")
  if rope % 2:
    raise HFFormatError(f"config.json qk_rope_head_dim={rope}: must be even for rotary "
                              f"embeddings")
  if value > nope + rope:
    raise HFFormatError(f"config.json v_head_dim={value}: above the query/key head dim "
                              f"{nope + rope} (qk_nope_head_dim + qk_rope_head_dim); "
                              f"unsupported")
  if get("rope_interleave") is False:
    raise HFFormatError("config.json rope_interleave=false: unsupported; jaxtrain reads "
                              "DeepSeek's interleaved RoPE layout (true)")
  return {"model.head_dim": nope + rope, "model.num_kv_heads": heads,
          "model.q_lora_rank": q_rank, "model.kv_lora_rank": kv_rank,
          "model.qk_rope_head_dim": rope, "model.v_head_dim": value}


def routing_overrides(hf: dict, get: Callable[[str], Any], experts: int,
                      num_layers: int) -> dict[str, Any]:
  """moe.* of DeepSeek's router: sigmoid scores with the correction bias, group-limited choice,
  scaled weights, shared experts, and the first `first_k_dense_replace` layers dense."""
  scoring = hf.get("scoring_func", "sigmoid")
  if scoring != "sigmoid":
    raise HFFormatError(f"config.json scoring_func={scoring!r}: unsupported; jaxtrain's "
                              f"deepseek_v3 router scores experts by a sigmoid ('sigmoid')")
  method = hf.get("topk_method", "noaux_tc")
  if method != "noaux_tc":
    raise HFFormatError(f"config.json topk_method={method!r}: unsupported; jaxtrain's "
                              f"deepseek_v3 router is DeepSeek-V3's ('noaux_tc')")
  groups, top_groups = int(get("n_group") or 1), int(get("topk_group") or 1)
  if experts % groups:
    raise HFFormatError(f"config.json n_group={groups}: does not divide "
                              f"n_routed_experts={experts}")
  if not 1 <= top_groups <= groups:
    raise HFFormatError(f"config.json topk_group={top_groups}: must be between 1 and "
                              f"n_group={groups}")
  dense = int(get("first_k_dense_replace") or 0)
  if not 0 <= dense < num_layers:
    raise HFFormatError(f"config.json first_k_dense_replace={dense}: must leave an MoE "
                              f"layer among num_hidden_layers={num_layers}")
  return {"moe.router_score": "sigmoid", "moe.router_bias": True, "moe.n_group": groups,
          "moe.topk_group": top_groups,
          "moe.routed_scaling_factor": float(get("routed_scaling_factor")),
          "moe.num_shared_experts": int(get("n_shared_experts") or 0),
          "moe.norm_topk_prob": bool(get("norm_topk_prob")),
          "moe.dense_layers": ",".join(str(i) for i in range(dense)), "moe.sparse_step": 1}


def export_fields(config) -> dict[str, Any]:
  """DeepSeek-V3's config.json fields of a run config (the inverse of the two above)."""
  m, moe = config.model, config.moe
  dense = [int(i) for i in str(moe.dense_layers).split(",") if i.strip()]
  if dense != list(range(len(dense))) or int(moe.sparse_step) != 1:
    raise HFFormatError(f"moe.dense_layers={moe.dense_layers!r}, moe.sparse_step="
                              f"{moe.sparse_step}: DeepSeek-V3's config.json can only say the "
                              f"first k layers are dense (first_k_dense_replace)")
  return {"q_lora_rank": int(m.q_lora_rank) or None, "kv_lora_rank": int(m.kv_lora_rank),
          "qk_rope_head_dim": int(m.qk_rope_head_dim),
          "qk_nope_head_dim": int(m.head_dim) - int(m.qk_rope_head_dim),
          "v_head_dim": int(m.v_head_dim), "n_routed_experts": int(moe.num_experts),
          "num_experts_per_tok": int(moe.experts_per_token),
          "moe_intermediate_size": int(moe.expert_mlp_dim) or int(m.mlp_dim),
          "n_shared_experts": int(moe.num_shared_experts), "n_group": int(moe.n_group),
          "topk_group": int(moe.topk_group),
          "routed_scaling_factor": float(moe.routed_scaling_factor),
          "norm_topk_prob": bool(moe.norm_topk_prob), "first_k_dense_replace": len(dense),
          "qk_head_dim": int(m.head_dim),
          # Exported after the decoder's layers, as the hub's checkpoints hold them.
          "num_nextn_predict_layers": int(m.get("mtp_depth", 0))}
