"""The DeepSeek-V3 cases of scripts/make_hf_fixtures.py: latent attention and DeepSeek's
router, with plain RoPE and with YaRN, each with the changes that must move its logits."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from hf_fixture_tools import ids_40, random_hf_model, write_case
from hf_family_fixtures import COMMON, sensitivity
from hf_moe_fixtures import moe_blocks


def _changes(yarn: bool) -> dict:
  """Wiring errors an import of DeepSeek-V3 could make."""
  def bias_ignored(m):
    for block in moe_blocks(m):
      block.gate.e_score_correction_bias.zero_()

  def scaling_ignored(m):
    for block in moe_blocks(m):
      block.gate.routed_scaling_factor = 1.0

  def groups_ignored(m):
    for block in moe_blocks(m):
      block.gate.topk_group = block.gate.num_group

  def shared_dropped(m):
    for block in moe_blocks(m):
      block.shared_experts.down_proj.weight.zero_()

  def rope_not_interleaved(m):
    m.config.rope_interleave = False

  def value_and_key_swapped(m):
    for layer in m.model.layers:
      attn = layer.self_attn
      w = attn.kv_b_proj.weight.view(attn.num_heads, -1, attn.kv_lora_rank)
      nope = attn.qk_nope_head_dim
      w.copy_(torch.cat([w[:, -nope:], w[:, :-nope]], dim=1))

  changes = {"the correction bias ignored in the choice": bias_ignored,
             "routed_scaling_factor read as 1": scaling_ignored,
             "every group eligible (topk_group = n_group)": groups_ignored,
             "shared experts dropped": shared_dropped,
             "RoPE dims read in the rotate-half order": rope_not_interleaved,
             "kv_b_proj's key and value rows swapped": value_and_key_swapped}
  if yarn:
    def mscale_all_dim_ignored(m):
      for layer in m.model.layers:
        layer.self_attn.scaling = layer.self_attn.qk_head_dim ** -0.5
    changes["the softmax scale without mscale_all_dim"] = mscale_all_dim_ignored
  return changes


def deepseek_v3_case(name: str, seed: int, yarn: bool):
  """3 layers (the first dense), 8 routed experts in 4 groups (top 3 within the best 2), one
  shared expert; with `yarn`, YaRN RoPE (factor 4 over 16 original positions, mscale and
  mscale_all_dim 0.707) and no query bottleneck (q_lora_rank null)."""
  rope = {"rope_type": "default", "rope_theta": 1e4}
  if yarn:
    # beta_fast/slow narrow enough that some RoPE dims keep, some interpolate, some ramp.
    rope = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
            "original_max_position_embeddings": 16, "beta_fast": 1.0, "beta_slow": 0.05,
            "mscale": 0.707, "mscale_all_dim": 0.707}
  config = DeepseekV3Config(
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
      q_lora_rank=None if yarn else 16, kv_lora_rank=12, qk_rope_head_dim=8,
      qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3,
      n_group=4, topk_group=2, moe_intermediate_size=16, n_shared_experts=1,
      routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
      tie_word_embeddings=False, rope_parameters=rope, **COMMON)
  model = random_hf_model(seed, DeepseekV3ForCausalLM, config)
  with torch.no_grad():  # a buffer, not a weight: random_hf_model leaves it at zero
    gen = torch.Generator().manual_seed(seed)
    for block in moe_blocks(model):
      block.gate.e_score_correction_bias.copy_(
          0.3 * torch.randn(block.gate.e_score_correction_bias.shape, generator=gen))
  kinds = ["moe" if hasattr(layer.mlp, "gate") else "dense" for layer in model.model.layers]
  covers = ("DeepseekV3ForCausalLM: 3 layers (" + ", ".join(kinds) + "), latent attention "
            f"(q_lora_rank {config.q_lora_rank}, kv_lora_rank 12, qk_nope 16 + qk_rope 8, "
            "v_head_dim 12, interleaved RoPE), 8 routed experts (sigmoid, correction bias "
            "~N(0, 0.3), 4 groups of which 2, top 3, scaled 2.5) + 1 shared, RoPE "
            + (f"yarn {rope}" if yarn else "default 1e4"))
  info = {"seed": seed, "family": "deepseek_v3", "layer_kinds": kinds, "covers": covers,
          "wiring_sensitivity": sensitivity(model, ids_40(), _changes(yarn))}
  write_case(name, model, ids_40(), info, verify=True)
