"""The Mixture-of-Experts cases of scripts/make_hf_fixtures.py: Mixtral and Qwen3-MoE (with a
dense first layer, and with top-k weights left unnormalized), each with the routing changes
that must move its logits."""

from __future__ import annotations

import numpy as np
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_fixture_tools import ids_40, random_hf_model, write_case
from hf_family_fixtures import COMMON, qwen_changes, sensitivity


def moe_blocks(model):
  """Each MoE layer's sparse block (dense layers have no router)."""
  return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def routing_changes(top_k: int) -> dict:
  """Wiring errors of any MoE import: the wrong k, an expert's gate and up swapped, the
  experts' order permuted (router rows read against the wrong experts)."""
  def top_k_minus_one(m):
    for block in moe_blocks(m):
      block.gate.top_k = top_k - 1

  def gate_up_swapped(m):
    for block in moe_blocks(m):
      w = block.experts.gate_up_proj
      half = w.shape[1] // 2
      w.copy_(torch.cat([w[:, half:], w[:, :half]], dim=1))

  def experts_rotated(m):
    for block in moe_blocks(m):
      for p in (block.experts.gate_up_proj, block.experts.down_proj):
        p.copy_(torch.roll(p, 1, dims=0))

  return {f"top {top_k - 1} experts instead of {top_k}": top_k_minus_one,
          "every expert's gate and up projections swapped": gate_up_swapped,
          "experts in the wrong order (router rows against the wrong expert)": experts_rotated}


def mixtral_case(name: str, seed: int):
  config = MixtralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         **{**COMMON, "intermediate_size": 48})
  model = random_hf_model(seed, MixtralForCausalLM, config)
  changes = routing_changes(2)
  changes.update(qwen_changes(1e6))
  info = {"seed": seed, "family": "mixtral",
          "covers": ("MixtralForCausalLM: 2 layers, each a Mixture of 4 experts (SwiGLU, "
                     "intermediate 48), top 2 renormalized, router block_sparse_moe.gate, "
                     "experts w1/w3/w2; GQA 4/2, rope_theta 1e6, untied embeddings"),
          "wiring_sensitivity": sensitivity(model, ids_40(), changes)}
  write_case(name, model, ids_40(), info, verify=True)


def qwen3_moe_case(name: str, seed: int, norm_topk_prob: bool, mlp_only_layers: list[int],
                   sparse_step: int, num_layers: int):
  config = Qwen3MoeConfig(num_hidden_layers=num_layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=24,
                          norm_topk_prob=norm_topk_prob, mlp_only_layers=mlp_only_layers,
                          decoder_sparse_step=sparse_step, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                          **COMMON)
  model = random_hf_model(seed, Qwen3MoeForCausalLM, config)

  def normalization_toggled(m):
    for block in moe_blocks(m):
      block.gate.norm_topk_prob = not norm_topk_prob

  def qk_norm_skipped(m):
    for layer in m.model.layers:
      layer.self_attn.q_norm.weight.fill_(1.0)
      layer.self_attn.k_norm.weight.fill_(1.0)

  changes = routing_changes(2)
  changes.update(qwen_changes(1e4))
  changes[f"norm_topk_prob read as {not norm_topk_prob}"] = normalization_toggled
  changes["q/k norm weights ignored"] = qk_norm_skipped
  kinds = ["moe" if hasattr(layer.mlp, "gate") else "dense" for layer in model.model.layers]
  info = {"seed": seed, "family": "qwen3_moe", "layer_kinds": kinds,
          "covers": (f"Qwen3MoeForCausalLM: {num_layers} layers ({', '.join(kinds)}: "
                     f"mlp_only_layers {mlp_only_layers}, decoder_sparse_step {sparse_step}), "
                     f"8 experts of moe_intermediate_size 24 (dense layers 64), top 2, "
                     f"norm_topk_prob {norm_topk_prob}; q/k norms, GQA 4/2, head_dim 16"),
          "wiring_sensitivity": sensitivity(model, ids_40(), changes)}
  assert np.isfinite(info["wiring_sensitivity"][f"norm_topk_prob read as {not norm_topk_prob}"])
  write_case(name, model, ids_40(), info, verify=True)
