"""The non-Llama cases of scripts/make_hf_fixtures.py: Qwen3, Qwen2, Mistral and Gemma 3 (text,
the older config spelling, multimodal), each with the wiring changes that must move its logits.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Callable

import numpy as np
import torch
from transformers import (Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration,
                          Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.activations import ACT2FN

from hf_fixture_tools import (LOGIT_TOL, ROOT, SEQ_LEN, VOCAB, ids_40, logits_and_loss,
                              random_hf_model, saved_tensor_names, write_case)

MUST_MOVE = 100 * LOGIT_TOL
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=64,
              rms_norm_eps=1e-6, attn_implementation="eager")


def logit_change(model, ids: np.ndarray, logits: np.ndarray, change: Callable) -> float:
  """Max abs difference between `logits` and those of a copy of `model` that `change` altered."""
  changed = copy.deepcopy(model)
  with torch.no_grad():
    change(changed)
  return float(np.abs(logits_and_loss(changed, ids)[0] - logits).max())


def sensitivity(model, ids: np.ndarray, changes: dict[str, Callable],
                informative: dict[str, Callable] | None = None) -> dict:
  """{description: max abs logit change} for each change; those in `changes` must exceed
  MUST_MOVE, those in `informative` are recorded only."""
  logits, _ = logits_and_loss(model, ids)
  out = {}
  for what, change in changes.items():
    out[what] = logit_change(model, ids, logits, change)
    assert out[what] > MUST_MOVE, f"{what}: logits move by only {out[what]:.3e}"
  for what, change in (informative or {}).items():
    out[what + " (informative)"] = logit_change(model, ids, logits, change)
  return out


def attns(model):
  return [layer.self_attn for layer in model.model.layers]


def rope_theta_read_as(theta: float, wrong: float) -> Callable:
  """The change: a single-RoPE model's inverse frequencies for base `wrong` instead of `theta`."""
  def change(m):
    rot = m.model.rotary_emb
    rot.inv_freq.copy_(rot.inv_freq.double().pow(math.log(wrong) / math.log(theta)).float())
  return change


def qwen_changes(theta: float) -> dict[str, Callable]:
  wrong = 1e6 if theta != 1e6 else 1e4
  return {f"rope_theta read as {wrong:g} instead of {theta:g}": rope_theta_read_as(theta, wrong)}


def qwen3_case(name: str, seed: int, tied: bool, theta: float, legacy: bool):
  config = Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, tie_word_embeddings=tied,
                       rope_parameters={"rope_type": "default", "rope_theta": theta}, **COMMON)
  model = random_hf_model(seed, Qwen3ForCausalLM, config)

  def no_qk_norm_weights(m):
    for a in attns(m):
      a.q_norm.weight.fill_(1.0)
      a.k_norm.weight.fill_(1.0)

  def qk_norm_skipped(m):
    for a in attns(m):
      a.q_norm.weight.fill_(1.0)
      a.k_norm.weight.fill_(1.0)
      a.q_norm.forward = a.k_norm.forward = lambda x: x

  changes = {"q_norm/k_norm weights ignored (all 1)": no_qk_norm_weights,
             "q_norm/k_norm skipped": qk_norm_skipped, **qwen_changes(theta)}
  info = {"seed": seed, "family": "qwen3",
          "covers": (f"Qwen3ForCausalLM, GQA 4/2, explicit head_dim 16 over hidden 32 (attention "
                     f"width 64), random q_norm/k_norm (RMSNorm over head_dim, before RoPE), "
                     f"{'tied' if tied else 'untied'} embeddings, rope_theta {theta:g}, "
                     + ("config.json rewritten to the old spelling (top-level rope_theta, "
                        "rope_scaling null, no layer_types, torch_dtype); logits from "
                        "transformers reloading it" if legacy else
                        "config in the transformers >= 5 spelling (rope_parameters)")),
          "config_spelling": "legacy" if legacy else "rope_parameters",
          "wiring_sensitivity": sensitivity(model, ids_40(), changes)}
  write_case(name, model, ids_40(), info, verify=True,
             rewrite_config=qwen3_legacy_spelling if legacy else None)


def qwen3_legacy_spelling(config: dict) -> dict:
  """Qwen3's config.json as transformers 4.5x wrote it (e.g. Qwen/Qwen3-0.6B): top-level
  rope_theta, rope_scaling null, no layer_types, torch_dtype."""
  rope = config.pop("rope_parameters")
  assert rope["rope_type"] == "default", rope
  config["rope_theta"] = rope["rope_theta"]
  config["rope_scaling"] = None
  assert set(config.pop("layer_types")) == {"full_attention"}
  config["torch_dtype"] = config.pop("dtype")
  return config


def qwen2_case(name: str, seed: int, tied: bool, theta: float):
  config = Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=tied,
                       rope_parameters={"rope_type": "default", "rope_theta": theta}, **COMMON)
  model = random_hf_model(seed, Qwen2ForCausalLM, config)

  def no_bias(proj):
    def change(m):
      for a in attns(m):
        getattr(a, proj).bias.zero_()
    return change

  changes = {f"{p} bias dropped": no_bias(p) for p in ("q_proj", "k_proj", "v_proj")}
  changes.update(qwen_changes(theta))
  info = {"seed": seed, "family": "qwen2",
          "covers": (f"Qwen2ForCausalLM, q/k/v projection biases (random, std 0.1; o_proj has "
                     f"none), GQA 4/2, head_dim 8, rope_theta {theta:g}, "
                     f"{'tied' if tied else 'untied'} embeddings"),
          "wiring_sensitivity": sensitivity(model, ids_40(), changes)}
  write_case(name, model, ids_40(), info, verify=True)


def mistral_case(name: str, seed: int, tied: bool, window: int | None, head_dim: int | None,
                 theta: float):
  config = MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim, tie_word_embeddings=tied, sliding_window=window,
                         rope_parameters={"rope_type": "default", "rope_theta": theta}, **COMMON)
  model = random_hf_model(seed, MistralForCausalLM, config)
  changes = dict(qwen_changes(theta))
  info = {"seed": seed, "family": "mistral"}
  if window is not None:
    def no_window(m):
      m.config.sliding_window = None
    ids = ids_40()
    logits, _ = logits_and_loss(model, ids)
    info["max_abs_logit_diff_vs_no_window"] = logit_change(model, ids, logits, no_window)
    assert info["max_abs_logit_diff_vs_no_window"] > MUST_MOVE
    changes["sliding window ignored"] = no_window

    def window_one_wider(m):
      m.config.sliding_window = window + 1
    changes[f"window {window + 1} instead of {window} (off by one)"] = window_one_wider
  info["covers"] = (
      f"MistralForCausalLM, sliding_window {window}"
      + (f" (< {SEQ_LEN} tokens: the window matters)" if window else "")
      + f", GQA 4/2, head_dim {head_dim or 32 // 4}"
      + (" (explicit, attention width 64 over hidden 32)" if head_dim else "")
      + f", rope_theta {theta:g}, {'tied' if tied else 'untied'} embeddings")
  info["wiring_sensitivity"] = sensitivity(model, ids_40(), changes)
  write_case(name, model, ids_40(), info, verify=True)


# Gemma 3 text: RoPE per layer type as transformers 5 writes it.
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
GEMMA3_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                   query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                   final_logit_softcapping=None, attn_logit_softcapping=None,
                   max_position_embeddings=64, rms_norm_eps=1e-6)
PATTERN_3 = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma3_text_config(tied: bool, layer_types: list[str] | None) -> Gemma3TextConfig:
  return Gemma3TextConfig(**GEMMA3_TEXT, tie_word_embeddings=tied, layer_types=layer_types,
                          rope_parameters=copy.deepcopy(GEMMA3_ROPE),
                          attn_implementation="eager")


def gemma3_changes(text_model_of: Callable) -> tuple[dict, dict]:
  """Wiring changes of a Gemma 3 text model, `text_model_of(model)` its Gemma3TextModel."""
  def norms_without_one(m):
    for mod in text_model_of(m).modules():
      if type(mod).__name__ == "Gemma3RMSNorm":
        mod.weight.sub_(1.0)  # x * (1 + (w - 1)) = x * w

  def unscaled_embedding(m):
    text_model_of(m).embed_tokens.embed_scale.fill_(1.0)

  def head_dim_scale(m):
    for layer in text_model_of(m).layers:
      layer.self_attn.scaling = layer.self_attn.head_dim ** -0.5

  def no_window(m):
    text_model_of(m).config.sliding_window = 1000

  def window_one_wider(m):
    text_model_of(m).config.sliding_window += 1

  def all_sliding(m):
    config = text_model_of(m).config
    config.layer_types = ["sliding_attention"] * len(config.layer_types)

  def ropes_swapped(m):
    rot = text_model_of(m).rotary_emb
    full, local = rot.full_attention_inv_freq.clone(), rot.sliding_attention_inv_freq.clone()
    rot.full_attention_inv_freq.copy_(local)
    rot.sliding_attention_inv_freq.copy_(full)

  def linear_factor_ignored(m):
    text_model_of(m).rotary_emb.full_attention_inv_freq.mul_(8.0)

  def no_qk_norm(m):
    for layer in text_model_of(m).layers:
      layer.self_attn.q_norm.forward = layer.self_attn.k_norm.forward = lambda x: x

  def no_sandwich_norms(m):
    for layer in text_model_of(m).layers:
      layer.post_attention_layernorm.forward = lambda x: x
      layer.post_feedforward_layernorm.forward = lambda x: x

  def exact_gelu(m):
    for layer in text_model_of(m).layers:
      layer.mlp.act_fn = ACT2FN["gelu"]

  changes = {"norms x * w instead of x * (1 + w)": norms_without_one,
             "embedding not scaled by sqrt(hidden_size)": unscaled_embedding,
             "softmax scale head_dim**-0.5 instead of query_pre_attn_scalar**-0.5": head_dim_scale,
             "sliding window ignored": no_window,
             "sliding window one wider": window_one_wider,
             "every layer sliding_attention": all_sliding,
             "RoPE of the two layer types swapped": ropes_swapped,
             "linear RoPE factor 8 of full_attention layers ignored": linear_factor_ignored,
             "q_norm/k_norm skipped": no_qk_norm,
             "post_attention/post_feedforward norms skipped": no_sandwich_norms}
  informative = {"exact gelu instead of gelu_pytorch_tanh": exact_gelu}
  return changes, informative


def gemma3_legacy_spelling(config: dict) -> dict:
  """Gemma 3's text config.json as transformers 4.5x wrote it (e.g. google/gemma-3-1b-it, with
  the 4b's linear rope_scaling): top-level rope_theta and rope_local_base_freq, rope_scaling,
  sliding_window_pattern instead of layer_types, torch_dtype, cache_implementation."""
  rope = config.pop("rope_parameters")
  assert rope == GEMMA3_ROPE, rope
  config["rope_theta"] = rope["full_attention"]["rope_theta"]
  config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
  config["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
  layer_types = config.pop("layer_types")
  assert layer_types == ["sliding_attention"] * 5 + ["full_attention"], layer_types
  config.pop("_sliding_window_pattern")
  config["sliding_window_pattern"] = 6
  config.pop("use_bidirectional_attention")
  config["cache_implementation"] = "hybrid"
  config["torch_dtype"] = config.pop("dtype")
  return config


GEMMA3_TEXT_COVERS = (
    "GQA 4/2, head_dim 16 over hidden 32, 6 layers, sliding_window 8 (< 40 tokens), "
    "query_pre_attn_scalar 24 (softmax scale 24**-0.5, not head_dim**-0.5), RoPE per layer type "
    "(full_attention: linear factor 8, theta 1e6; sliding_attention: default, theta 1e4), every "
    "norm weight ~ N(0, 0.3) (x * (1 + w)), q_norm/k_norm, sandwich norms, embeddings scaled by "
    "sqrt(32), gelu_pytorch_tanh, no softcapping")


def gemma3_text_case(name: str, seed: int, legacy: bool):
  config = gemma3_text_config(tied=not legacy, layer_types=None if legacy else PATTERN_3)
  model = random_hf_model(seed, Gemma3ForCausalLM, config, norm_center=0.0)
  changes, informative = gemma3_changes(lambda m: m.model)
  if legacy:
    covers = ("Gemma3ForCausalLM (gemma3_text), untied, layer_types from sliding_window_pattern 6 "
              "(layers 0-4 sliding, 5 full), " + GEMMA3_TEXT_COVERS + "; config.json rewritten "
              "to the transformers 4.5x spelling (rope_theta, rope_local_base_freq, rope_scaling "
              "{rope_type linear, factor 8}, sliding_window_pattern 6, no layer_types, "
              "torch_dtype, cache_implementation hybrid); logits from transformers reloading it")
  else:
    covers = ("Gemma3ForCausalLM (gemma3_text), tied, layer_types sliding x2, full, sliding x2, "
              "full (config.json also carries transformers' _sliding_window_pattern 6, which "
              "layer_types overrides), " + GEMMA3_TEXT_COVERS)
  info = {"seed": seed, "family": "gemma3_text",
          "config_spelling": "legacy (transformers 4.5x)" if legacy else "rope_parameters",
          "covers": covers,
          "wiring_sensitivity": sensitivity(model, ids_40(), changes, informative)}
  info = write_case(name, model, ids_40(), info, verify=True,
                    rewrite_config=gemma3_legacy_spelling if legacy else None)
  if legacy:
    reload = info["reload"]
    assert reload["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert reload["rope_parameters"] == GEMMA3_ROPE, reload["rope_parameters"]


# Gemma 3 multimodal: image tokens at the top of the vocabulary, never among the inputs.
BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
SIGLIP_TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, image_size=8, patch_size=4, vision_use_head=False)


def gemma3_multimodal_case(name: str, seed: int):
  text = gemma3_text_config(tied=True, layer_types=PATTERN_3).to_dict()
  config = Gemma3Config(text_config=text, vision_config=SIGLIP_TINY, mm_tokens_per_image=4,
                        boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE,
                        tie_word_embeddings=True, attn_implementation="eager")
  model = random_hf_model(seed, Gemma3ForConditionalGeneration, config, norm_center=0.0)
  ids = np.random.default_rng(2).integers(0, BOI, (2, SEQ_LEN))
  assert ids.max() < BOI
  logits, _ = logits_and_loss(model, ids)
  # The text-only logits are those of a Gemma3ForCausalLM holding the same text weights.
  text_lm = Gemma3ForCausalLM(model.config.text_config).eval()
  with torch.no_grad():
    text_lm.model.load_state_dict(model.model.language_model.state_dict())
    text_lm.lm_head.weight.copy_(model.lm_head.weight)
  text_only_err = float(np.abs(logits_and_loss(text_lm, ids)[0] - logits).max())
  assert text_only_err <= 1e-6, text_only_err
  changes, informative = gemma3_changes(lambda m: m.model.language_model)
  info = {"seed": seed, "family": "gemma3 (multimodal)",
          "covers": ("Gemma3ForConditionalGeneration (gemma3): text_config like hf_gemma3_text's "
                     "(tied, 6 layers, sliding x2 full x2), a tiny SigLIP vision tower (hidden 16, "
                     "1 layer, 2 heads, image 8, patch 4, no head) and projector "
                     "(mm_tokens_per_image 4); text-only inputs below boi/eoi/image token ids "
                     f"{BOI}/{EOI}/{IMAGE}; tensors named as save_pretrained writes them"),
          "text_only_vs_gemma3_for_causal_lm_max_abs_diff": text_only_err,
          "wiring_sensitivity": sensitivity(model, ids, changes, informative)}
  out = os.path.join(ROOT, name)
  info = write_case(name, model, ids, info, verify=True)
  names = saved_tensor_names(out)
  prefixes = sorted({n[:n.index("embed_tokens.weight")] for n in names
                     if n.endswith("embed_tokens.weight")})
  assert len(prefixes) == 1, prefixes
  info["text_tensor_prefix"] = prefixes[0]  # before embed_tokens.weight, layers.N., norm.weight
  info["lm_head_saved"] = any("lm_head" in n for n in names)
  info["non_text_tensor_prefixes"] = sorted({n.split(".")[0] + "." for n in names
                                             if not n.startswith(prefixes[0])})
  with open(os.path.join(out, "fixture_info.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=2)


