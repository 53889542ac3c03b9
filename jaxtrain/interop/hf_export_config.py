"""jaxtrain config -> Hugging Face `config.json`: what transformers loads as the family's
*ForCausalLM, or for a reward model (a score head) its *ForSequenceClassification (the reading
direction, and what both share, is in hf_config.py).

It writes the transformers >= 5 spelling by default (what `save_pretrained` writes today) or the
older one on request (`rope_spelling="rope_scaling"`), for readers older than transformers 5,
which ignore `rope_parameters`. A model whose math the family's config class cannot express (a
window on Llama, mixed layer types on Mistral, a softmax scale outside Gemma 3) is refused in
one line rather than written as something else.
"""

from __future__ import annotations

from typing import Any

from jaxtrain.interop.hf_config import (DTYPES, HF_ACTIVATIONS, OUR_LAYER_TYPES, ROPE_SPELLINGS,
                                        HFFormatError, defaults_of, pattern_layer_types)
from jaxtrain.interop import hf_deepseek
from jaxtrain.models import registry
from jaxtrain.models.config import FULL, SLIDING, architecture_of
from jaxtrain.models.features import Family
from jaxtrain.models.rope import YARN_KEYS



def _rope_dict(m) -> dict[str, Any]:
  """config.model's (full layers') RoPE scaling as Hugging Face spells it."""
  rs = m.rope_scaling
  if rs.type == "llama3":
    return {"rope_type": "llama3", "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": int(rs.original_max_position_embeddings)}
  if rs.type == "linear":
    return {"rope_type": "linear", "factor": float(rs.factor)}
  if rs.type == "yarn":
    return {"rope_type": "yarn", **{key: int(rs[key]) if key == "original_max_position_embeddings"
                                    else float(rs[key]) for key in YARN_KEYS}}
  return {"rope_type": "default"}


def _check_expressible(m, family: Family, sliding: list[bool]) -> None:
  """Refuses export of a model whose math the family's config class cannot express."""
  defaults = defaults_of(family)
  if "query_pre_attn_scalar" not in defaults and m.query_pre_attn_scalar and (
      m.query_pre_attn_scalar != m.head_dim):
    raise HFFormatError(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar}: "
                        f"{family.hf_architecture} has no query_pre_attn_scalar; export needs 0 "
                        f"(head_dim) for model.family={family.name!r}")
  if ("rope_local_base_freq" not in defaults and m.local_rope_theta and any(sliding)
      and (m.local_rope_theta != m.rope_theta or m.rope_scaling.type != "none")):
    raise HFFormatError(f"model.local_rope_theta={m.local_rope_theta}: {family.hf_architecture} "
                        f"has one RoPE for all layers; export needs 0 for "
                        f"model.family={family.name!r}")
  scheme = family.hf_window
  if scheme == "none" and any(sliding):
    raise HFFormatError(f"model.sliding_window={m.sliding_window}: {family.hf_architecture} has "
                        f"no sliding window; export needs 0 for model.family={family.name!r}")
  if scheme in ("every", "all") and any(sliding) and not all(sliding):
    raise HFFormatError(f"model.layer_types={m.layer_types!r}: {family.hf_architecture} applies "
                        f"sliding_window to every layer; export needs every layer alike")


# The *ForSequenceClassification of an export model_type whose name is not the *ForCausalLM's
# with the suffix replaced (Gemma3ForSequenceClassification is the multimodal model's).
SEQUENCE_CLASSIFIERS = {"gemma3_text": "Gemma3TextForSequenceClassification"}


def sequence_classifier(family: Family) -> str:
  """The transformers class a reward model of `family` exports as."""
  return SEQUENCE_CLASSIFIERS.get(
      family.hf_model_types[0], family.hf_architecture.removesuffix("ForCausalLM")
      + "ForSequenceClassification")


def score_pad_id(pad_id: int | None, bos_id: int | None, eos_id: int | None) -> int | None:
  """A reward model's `pad_token_id`. transformers' *ForSequenceClassification scores the
  rightmost token that is not pad_token_id (and refuses batches of several rows without one);
  jaxtrain scores the last token its attention mask keeps, which ends a response with EOS in the
  preference data. They agree on right-padded rows whose last real token is never the pad id: the
  tokenizer's own pad token when it has one other than EOS, else BOS (never a last token); None
  when the tokenizer has neither (one row at a time in transformers)."""
  if pad_id is not None and pad_id != eos_id:
    return pad_id
  return bos_id


def _score_head_fields(m, pad_id: int | None) -> dict[str, Any]:
  """What a *ForSequenceClassification's config.json adds: one label (transformers 5 reads the
  count from id2label, older readers from num_labels) and the padding token that pools a row."""
  if int(m.mtp_depth):
    raise HFFormatError(f"model.mtp_depth={m.mtp_depth} with a score head: "
                        f"*ForSequenceClassification has no multi-token-prediction layers; "
                        f"export needs model.mtp_depth=0")
  return {"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
          "pad_token_id": pad_id}


def _export_window(m, family: Family, sliding: list[bool]) -> dict[str, Any]:
  """The sliding-window fields of the family's config class."""
  scheme = family.hf_window
  window = int(m.sliding_window) if any(sliding) else None
  types = [OUR_LAYER_TYPES[SLIDING if s else FULL] for s in sliding]
  if scheme == "every":
    return {"sliding_window": window}
  if scheme == "all":
    return {"use_sliding_window": window is not None, "sliding_window": window}
  if scheme == "qwen":
    leading_full = next((i for i, s in enumerate(sliding) if s), len(sliding))
    return {"use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": leading_full, "layer_types": types}
  if scheme == "typed":
    # Gemma3TextConfig builds its sliding mask whatever the layer types: keep a window there.
    return {"sliding_window": window or int(defaults_of(family)["sliding_window"]),
            "layer_types": types}
  return {}


def _export_moe(config, family: Family) -> dict[str, Any]:
  """The MoE fields of an MoE family's config.json (none for a dense family)."""
  names, moe = family.hf_experts, config.moe
  if names is None:
    if moe.num_experts:
      raise HFFormatError(f"moe.num_experts={moe.num_experts}: model.family={family.name!r} has "
                          f"no Mixture-of-Experts layout to export to; use mixtral or qwen3_moe")
    return {}
  if names.router_bias:  # DeepSeek's router and layer pattern (interop/hf_deepseek.py)
    return hf_deepseek.export_fields(config)
  moe_layers = architecture_of(config).moe_layers()
  k = int(moe.experts_per_token)
  # transformers 5 saves the expert count as num_local_experts for every family, 4 reads the
  # family's own key: both. Its load-balancing loss is k times ours (hf_config.py).
  out = {names.num_experts_key: int(moe.num_experts), "num_local_experts": int(moe.num_experts),
         "num_experts_per_tok": k,
         names.expert_mlp_key: int(moe.expert_mlp_dim or config.model.mlp_dim),
         "router_aux_loss_coef": float(moe.aux_loss_coef) / k}
  if "norm_topk_prob" in defaults_of(family):
    out["norm_topk_prob"] = bool(moe.norm_topk_prob)
  elif not moe.norm_topk_prob:
    raise HFFormatError(f"moe.norm_topk_prob=False: {family.hf_architecture} always "
                        f"renormalizes the top-k weights; export needs True")
  if "mlp_only_layers" in defaults_of(family):
    out["mlp_only_layers"] = [i for i, m in enumerate(moe_layers)
                              if not m and (i + 1) % int(moe.sparse_step) == 0]
    out["decoder_sparse_step"] = int(moe.sparse_step)
  elif not all(moe_layers):
    raise HFFormatError(f"moe.dense_layers={moe.dense_layers!r}: {family.hf_architecture} has "
                        f"no dense layers; export needs every layer MoE")
  return out


def from_jaxtrain_config(config, *, dtype: str, bos_id: int | None = None,
                         eos_id: int | None = None, pad_id: int | None = None,
                         rope_spelling: str = "rope_parameters") -> dict[str, Any]:
  """A config.json (as a dict) that transformers loads as the family's *ForCausalLM, or for a
  reward model its *ForSequenceClassification with one label and pad_token_id `score_pad_id`
  of the tokenizer's ids (`pad_id`: its pad token's, None when it has none)."""
  m = config.model
  family = registry.get(m.family)
  score_head = architecture_of(config).score_head
  if dtype not in DTYPES:
    raise HFFormatError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
  if rope_spelling not in ROPE_SPELLINGS:
    raise HFFormatError(f"rope_spelling={rope_spelling!r}: choose one of "
                        f"{', '.join(ROPE_SPELLINGS)}")
  if m.d_model % m.num_heads:
    # transformers' config validation refuses this even when head_dim is given.
    raise HFFormatError(f"model.d_model={m.d_model}: transformers requires hidden_size to be "
                        f"divisible by num_attention_heads={m.num_heads}")
  defaults = defaults_of(family)
  sliding = list(architecture_of(config).sliding_layers())
  _check_expressible(m, family, sliding)
  act_key = "hidden_activation" if "hidden_activation" in defaults else "hidden_act"
  hf = {
      "architectures": [sequence_classifier(family) if score_head else family.hf_architecture],
      "model_type": family.hf_model_types[0],
      "vocab_size": int(m.vocab_size),
      "hidden_size": int(m.d_model),
      "intermediate_size": int(m.mlp_dim),
      "num_hidden_layers": int(m.num_layers),
      "num_attention_heads": int(m.num_heads),
      "num_key_value_heads": int(m.num_kv_heads),
      "head_dim": int(m.head_dim),
      act_key: HF_ACTIVATIONS[family.features.mlp_activation][0],
      "max_position_embeddings": int(m.max_position_embeddings),
      "initializer_range": float(m.init_std),
      "rms_norm_eps": float(m.norm_eps),
      "tie_word_embeddings": bool(m.tie_embeddings),
      **family.hf_export_fields,
      "attention_dropout": 0.0,
      "use_cache": True,
      "bos_token_id": bos_id,
      "eos_token_id": eos_id,
      "pad_token_id": None,
  }
  if "query_pre_attn_scalar" in defaults:
    scalar = float(m.query_pre_attn_scalar or m.head_dim)
    hf["query_pre_attn_scalar"] = int(scalar) if scalar.is_integer() else scalar
  if score_head:
    hf.update(_score_head_fields(m, score_pad_id(pad_id, bos_id, eos_id)))
  hf.update(_export_window(m, family, sliding))
  hf.update(_export_moe(config, family))
  if int(m.kv_lora_rank):  # latent attention: the checkpoint's head_dim is the RoPE part
    hf["head_dim"] = int(m.qk_rope_head_dim)
  rope = _rope_dict(m)
  per_type = "rope_local_base_freq" in defaults
  local = float(m.local_rope_theta)
  if rope_spelling == "rope_parameters":
    full = {**rope, "rope_theta": float(m.rope_theta)}
    if per_type:  # sliding layers: their own plain RoPE, or the full layers' one
      hf["rope_parameters"] = {
          "full_attention": full,
          "sliding_attention": ({"rope_type": "default", "rope_theta": local} if local
                                else dict(full))}
    else:
      hf["rope_parameters"] = full
    hf["dtype"] = dtype
  else:
    hf["rope_theta"] = float(m.rope_theta)
    hf["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    if per_type:
      if not local and rope["rope_type"] != "default" and any(sliding):
        raise HFFormatError("rope_spelling='rope_scaling': cannot give sliding layers the full "
                            "layers' scaled RoPE (model.local_rope_theta=0); export with "
                            "rope_spelling='rope_parameters'")
      hf["rope_local_base_freq"] = local or float(m.rope_theta)
      for pattern in range(1, m.num_layers + 2):
        if pattern_layer_types(pattern, m.num_layers) == hf["layer_types"]:
          hf["sliding_window_pattern"] = pattern  # for readers older than layer_types
          break
    hf["torch_dtype"] = dtype
  return hf
