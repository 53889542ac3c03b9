"""The DeepSeek-V3 cases of scripts/make_hf_fixtures.py: latent attention and DeepSeek's
router, with plain RoPE and with YaRN, each with the changes that must move its logits; and a
checkpoint holding its multi-token-prediction layer as DeepSeek-V3's hub checkpoints do, with
the logits of transformers' own prediction layer (modeling_layers.MtpLayer)."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import MtpLayer, MtpModel
from transformers.models.deepseek_v3 import modeling_deepseek_v3

from hf_fixture_tools import ROOT, ids_40, random_hf_model, write_case
from hf_family_fixtures import COMMON, sensitivity
from hf_moe_fixtures import moe_blocks


def _changes(yarn: bool, mscale: float = 0.707, mscale_all_dim: float = 0.707) -> dict:
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
  if yarn and mscale != mscale_all_dim:
    # Only here does YaRN's factor on the rotated query and key, mscale(factor, mscale) /
    # mscale(factor, mscale_all_dim), differ from 1 (equal mscales cancel it).
    def attention_factor_dropped(m):
      m.model.rotary_emb.attention_scaling = 1.0

    def mscale_all_dim_read_as_mscale(m):
      factor = m.config.rope_parameters["factor"]
      m.model.rotary_emb.attention_scaling = 1.0
      for layer in m.model.layers:
        attn = layer.self_attn
        attn.scaling = attn.qk_head_dim ** -0.5 * _yarn_mscale(factor, mscale) ** 2

    def mscales_swapped(m):
      factor = m.config.rope_parameters["factor"]
      m.model.rotary_emb.attention_scaling = (_yarn_mscale(factor, mscale_all_dim)
                                              / _yarn_mscale(factor, mscale))
      for layer in m.model.layers:
        attn = layer.self_attn
        attn.scaling = attn.qk_head_dim ** -0.5 * _yarn_mscale(factor, mscale) ** 2

    changes.update({
        "the rotated query and key without mscale / mscale_all_dim": attention_factor_dropped,
        "mscale_all_dim read as mscale": mscale_all_dim_read_as_mscale,
        "mscale and mscale_all_dim swapped": mscales_swapped})
  return changes


def _yarn_mscale(factor: float, mscale: float) -> float:
  """transformers' YaRN get_mscale: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _model(seed: int, yarn: bool, mscale: float = 0.707, mscale_all_dim: float = 0.707,
           num_layers: int = 3):
  """`num_layers` layers (the first dense), 8 routed experts in 4 groups (top 3 within the best
  2), one shared expert; with `yarn`, YaRN RoPE (factor 4 over 16 original positions, mscale and
  mscale_all_dim 0.707 unless given) and no query bottleneck (q_lora_rank null). Returns (model,
  covers)."""
  rope = {"rope_type": "default", "rope_theta": 1e4}
  if yarn:
    # beta_fast/slow narrow enough that some RoPE dims keep, some interpolate, some ramp.
    rope = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
            "original_max_position_embeddings": 16, "beta_fast": 1.0, "beta_slow": 0.05,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim}
  config = DeepseekV3Config(
      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
      q_lora_rank=None if yarn else 16, kv_lora_rank=12, qk_rope_head_dim=8,
      qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3,
      n_group=4, topk_group=2, moe_intermediate_size=16, n_shared_experts=1,
      routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
      tie_word_embeddings=False, rope_parameters=rope, **COMMON)
  model = random_hf_model(seed, DeepseekV3ForCausalLM, config)
  _random_correction_biases(moe_blocks(model), seed)
  kinds = ["moe" if hasattr(layer.mlp, "gate") else "dense" for layer in model.model.layers]
  covers = (f"DeepseekV3ForCausalLM: {num_layers} layers (" + ", ".join(kinds) + "), latent "
            f"attention (q_lora_rank {config.q_lora_rank}, kv_lora_rank 12, qk_nope 16 + "
            "qk_rope 8, v_head_dim 12, interleaved RoPE), 8 routed experts (sigmoid, correction bias "
            "~N(0, 0.3), 4 groups of which 2, top 3, scaled 2.5) + 1 shared, RoPE "
            + (f"yarn {rope}" if yarn else "default 1e4"))
  return model, kinds, covers


def _random_correction_biases(blocks, seed: int) -> None:
  """The MoE blocks' correction biases ~ N(0, 0.3): a buffer, not a weight, which
  random_hf_model leaves at zero."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for block in blocks:
      block.gate.e_score_correction_bias.copy_(
          0.3 * torch.randn(block.gate.e_score_correction_bias.shape, generator=gen))


def deepseek_v3_case(name: str, seed: int, yarn: bool, **model_kwargs):
  """`model_kwargs`: _model's mscale, mscale_all_dim, num_layers."""
  model, kinds, covers = _model(seed, yarn, **model_kwargs)
  mscales = {k: v for k, v in model_kwargs.items() if k.startswith("mscale")}
  info = {"seed": seed, "family": "deepseek_v3", "layer_kinds": kinds, "covers": covers,
          "wiring_sensitivity": sensitivity(model, ids_40(), _changes(yarn, **mscales))}
  write_case(name, model, ids_40(), info, verify=True)


# --- the multi-token-prediction layer ---------------------------------------------------------


def _prediction_layer(model, seed: int) -> MtpLayer:
  """transformers' prediction layer for `model` (an MoE decoder layer inside, as DeepSeek-V3's:
  get_mtp_config sets first_k_dense_replace to 0), weights drawn as random_hf_model draws them."""
  layer = MtpLayer(model.config.get_mtp_config(), modeling_deepseek_v3.DeepseekV3DecoderLayer,
                   modeling_deepseek_v3.DeepseekV3RMSNorm, 0).eval()
  gen = torch.Generator().manual_seed(seed + 1000)
  with torch.no_grad():
    for name, p in layer.named_parameters():
      if re.search(r"norm\.weight$", name):
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
      else:
        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
  _random_correction_biases([layer.mtp_block.mlp], seed + 1000)
  return layer


def _hub_names(layer: MtpLayer, model, index: int) -> dict[str, torch.Tensor]:
  """The layer's tensors under DeepSeek-V3's hub names (model.layers.{index}.*: its decoder
  layer's tensors, enorm, hnorm, eh_proj, shared_head.norm), with the copies of the embedding
  and the output head that those checkpoints carry in every prediction layer."""
  prefix = f"model.layers.{index}."
  out = {}
  for key, value in layer.state_dict().items():
    key = key.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
    out.update(_per_expert(prefix + key, value.detach().clone()))
  out[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
  out[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
  return out


def _per_expert(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
  """transformers 5 holds an MoE block's experts fused (experts.gate_up_proj [X, 2M, D],
  experts.down_proj [X, D, M]); checkpoints store one tensor per expert and projection, which
  its save_pretrained writes back (checked against the main layers in deepseek_v3_mtp_case)."""
  if name.endswith(".experts.gate_up_proj"):
    base, half = name.removesuffix("gate_up_proj"), value.shape[1] // 2
    return {**{f"{base}{j}.gate_proj.weight": w[:half].contiguous() for j, w in enumerate(value)},
            **{f"{base}{j}.up_proj.weight": w[half:].contiguous() for j, w in enumerate(value)}}
  if name.endswith(".experts.down_proj"):
    base = name.removesuffix("down_proj")
    return {f"{base}{j}.down_proj.weight": w.contiguous() for j, w in enumerate(value)}
  return {name: value.contiguous()}


def _mtp_logits(model, layer: MtpLayer, ids: np.ndarray, change: str = "") -> np.ndarray:
  """[B, T - 1, V]: at position t, the prediction layer's logits for token t + 2, from the main
  model's last layer output at t (before the final norm) and the embedding of token t + 1, at
  the positions of the tokens it reads (as transformers' MtpModel runs it). `change`: a wiring
  error, to show the logits move."""
  tokens = torch.tensor(ids, dtype=torch.long)
  captured = {}

  def keep(_, __, output):
    captured["h"] = output[0] if isinstance(output, tuple) else output
  hook = model.model.layers[-1].register_forward_hook(keep)
  with torch.no_grad():
    model(tokens)
    hook.remove()
    h_BTD = captured["h"]
    if change == "after the final norm":
      h_BTD = model.model.norm(h_BTD)
    following = tokens[:, :-1] if change == "token t, not t + 1" else tokens[:, 1:]
    emb_BTD = model.model.embed_tokens(following)
    positions = torch.arange(1, tokens.shape[1])[None].expand(tokens.shape[0], -1)
    rope = model.model.rotary_emb(emb_BTD, position_ids=positions)
    mask = create_causal_mask(config=layer.config, inputs_embeds=emb_BTD, attention_mask=None,
                              past_key_values=None, position_ids=positions)
    if change == "hidden state and embedding swapped":
      layer.config.mtp_hidden_states_first = True
    out = layer(emb_BTD, h_BTD[:, :-1], position_embeddings=rope, attention_mask=mask,
                position_ids=positions, past_key_values=None)
    layer.config.mtp_hidden_states_first = False
    return model.lm_head(out).float().numpy()


def deepseek_v3_mtp_case(name: str, seed: int):
  """hf_deepseek_v3's architecture whose checkpoint also holds one multi-token-prediction layer
  (model.layers.3.*, config.json num_nextn_predict_layers=1), and mtp_logits.npy from
  transformers' MtpLayer. transformers itself loads the layer back (MtpModel.from_pretrained)
  with the same weights, so the names are the ones its loader maps."""
  model, kinds, covers = _model(seed, yarn=False)
  ids = ids_40()
  layer = _prediction_layer(model, seed)
  mtp_logits = _mtp_logits(model, layer, ids)
  changes = ("after the final norm", "token t, not t + 1", "hidden state and embedding swapped")
  info = {"seed": seed, "family": "deepseek_v3", "layer_kinds": kinds,
          "covers": covers + "; one multi-token-prediction layer (an MoE layer) stored as "
                             "model.layers.3.*",
          "wiring_sensitivity": sensitivity(model, ids, _changes(False)),
          "mtp_wiring_sensitivity": {
              c: float(np.abs(_mtp_logits(model, layer, ids, c) - mtp_logits).max())
              for c in changes},
          "mtp_logits_abs_max": float(np.abs(mtp_logits).max())}
  info = write_case(name, model, ids, info, verify=True)
  out = os.path.join(ROOT, name)
  weights = os.path.join(out, "model.safetensors")
  tensors = load_file(weights)
  last = model.config.num_hidden_layers - 1  # an MoE layer, stored by save_pretrained
  assert {k: v for k, v in tensors.items() if f"layers.{last}.mlp" in k}.keys() == {
      k for k in _per_expert_state(model.model.layers[last].mlp, f"model.layers.{last}.mlp.")}
  for k, v in _per_expert_state(model.model.layers[last].mlp, f"model.layers.{last}.mlp.").items():
    assert torch.equal(tensors[k], v), k
  extra = _hub_names(layer, model, model.config.num_hidden_layers)
  save_file({**tensors, **extra}, weights, metadata={"format": "pt"})
  np.save(os.path.join(out, "mtp_logits.npy"), mtp_logits.astype(np.float32))
  _check_transformers_loads_it(out, layer, ids, model.config.num_hidden_layers)
  info["mtp_tensors"] = sorted(extra)
  with open(os.path.join(out, "fixture_info.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)
  print(f"{name}: {len(extra)} prediction-layer tensors, mtp logits max "
        f"{info['mtp_logits_abs_max']:.2f}, sensitivity {info['mtp_wiring_sensitivity']}")


def _per_expert_state(module, prefix: str) -> dict[str, torch.Tensor]:
  out = {}
  for key, value in module.state_dict().items():
    out.update(_per_expert(prefix + key, value.detach().clone()))
  return out


def _check_transformers_loads_it(out: str, layer: MtpLayer, ids: np.ndarray, index: int):
  """The main model loads with the same logits (the prediction layer left out), and
  transformers' MtpModel loader finds every prediction-layer weight under its hub name."""
  reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  want = np.load(os.path.join(out, "logits.npy"))
  with torch.no_grad():
    got = reloaded(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
  assert np.array_equal(got, want), "the prediction layer changed the main model's logits"
  # The class names the hub model's layer 61; this checkpoint's is layer `index`.
  reloaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{index}.*"]  # pylint: disable=protected-access
  loaded = MtpModel.from_pretrained(reloaded).layers[0]
  for key, value in layer.state_dict().items():
    assert torch.equal(loaded.state_dict()[key], value), key


def exported_mtp_error(loaded, fixture: str, ids: np.ndarray) -> dict:
  """transformers' MtpModel loads the prediction layer of jaxtrain's export (`loaded`: the
  export's main model) and computes the fixture's prediction-layer logits from it."""
  index = loaded.config.num_hidden_layers
  loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{index}.*"]  # pylint: disable=protected-access
  layer = MtpModel.from_pretrained(loaded).layers[0].eval()
  err = float(np.abs(_mtp_logits(loaded, layer, ids)
                     - np.load(os.path.join(fixture, "mtp_logits.npy"))).max())
  assert err <= 1e-4, f"{fixture}: the exported prediction layer's logits off by {err:.3e}"
  print(f"transformers' MtpModel loads the exported prediction layer: max abs logit error "
        f"{err:.3e}")
  return {"mtp_max_abs_logit_error": err}
