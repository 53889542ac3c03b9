"""Hugging Face `config.json` <-> jaxtrain config, in both directions, for every model family,
with clear refusals.

`model_type` picks the family (jaxtrain/models/registry.py: llama, qwen3, qwen2, mistral,
gemma3_text, and the text part of a multimodal gemma3 checkpoint, its `text_config`). Import
reads every field that changes the forward pass and refuses, in one line naming the field and
the supported values, what our decoder cannot run (another activation, biases the family has
none of, RoPE types other than default, llama3 and linear, logit softcapping, bidirectional
attention, partial rotary, quantized weights) rather than converting into a model that silently
computes something else. RoPE parameters come in two spellings, both read (hf_rope.py):

  transformers >= 5:  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
                      Gemma 3: one entry per layer type, {"full_attention": {...},
                        "sliding_attention": {...}}
  older files:        "rope_theta": 500000.0,
                      "rope_scaling": {"rope_type" (or "type"): "llama3", "factor": 8.0, ...}
                      Gemma 3: rope_theta and rope_scaling for the full-attention layers,
                        rope_local_base_freq for the sliding ones

Which layers attend within a sliding window is spelled per config class: Mistral's
`sliding_window` covers every layer (null: none); Qwen2/Qwen3 mark layers from
`max_window_layers` on when `use_sliding_window` is true, or list `layer_types`; Gemma 3 lists
`layer_types` or gives the older `sliding_window_pattern` (every Nth layer full).

Defaults for absent optional fields are transformers' config class defaults (the family's
`hf_defaults`), so a sparse file means here what it means there. The other direction, writing a
config.json for export, is hf_export_config.py.

A reward model is a `<Family>ForSequenceClassification` checkpoint (config.json `architectures`)
with one label: it imports with `model.score_head=True` (its `score.weight` [1, D] is our
`score_D1`), `train.objective="reward"` and `data.format="preference"`. Its number of labels is
transformers' reading of the file: the length of `id2label`, else `num_labels`, else 2; any other
than 1 is refused.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from jaxtrain.config import default_config
from jaxtrain.interop import hf_deepseek
from jaxtrain.interop.hf_errors import HFFormatError
from jaxtrain.interop.hf_rope import HF_LAYER_TYPES, field, rope_of
from jaxtrain.models import registry
from jaxtrain.models.config import FULL, SLIDING
from jaxtrain.models.features import Family

# Defaults every family's config class shares (the family's hf_defaults come on top).
COMMON_DEFAULTS = {
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
}
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
OUR_LAYER_TYPES = {ours: theirs for theirs, ours in HF_LAYER_TYPES.items()}
# Features.mlp_activation -> (the hidden_act transformers names it by, the MLP's name).
HF_ACTIVATIONS = {"silu": ("silu", "SwiGLU"), "gelu_tanh": ("gelu_pytorch_tanh", "GeGLU")}
# Fields that change the forward pass when set and that no family here implements.
SOFTCAPPING_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping")
# Our dtype names <-> the names config.json uses (torch's, without the "torch." prefix).
DTYPES = ("float32", "bfloat16", "float16")
ROPE_SPELLINGS = ("rope_parameters", "rope_scaling")


def read_hf_config(directory: str) -> dict[str, Any]:
  """The parsed config.json of a Hugging Face model directory."""
  path = os.path.join(directory, "config.json")
  if not os.path.isdir(directory):
    raise HFFormatError(f"{directory}: no such directory; expected a Hugging Face model "
                        f"directory with config.json and *.safetensors")
  if not os.path.isfile(path):
    raise HFFormatError(f"{directory}: has no config.json; expected a Hugging Face model "
                        f"directory (config.json and *.safetensors)")
  try:
    with open(path, encoding="utf-8") as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise HFFormatError(f"{path}: cannot read it as JSON ({type(e).__name__}: {e})") from e
  if not isinstance(hf, dict):
    raise HFFormatError(f"{path}: expected a JSON object, got {type(hf).__name__}")
  return hf


def family_of(hf: dict) -> Family:
  """The family whose model_type config.json names; HFFormatError listing them otherwise."""
  model_type = hf.get("model_type")
  family = registry.for_hf_model_type(model_type)
  if family is None:
    raise HFFormatError(f"config.json model_type={model_type!r}: unsupported; jaxtrain imports "
                        f"model_type {', '.join(registry.hf_model_types())}")
  return family


def text_config(hf: dict) -> dict[str, Any]:
  """The decoder's part of config.json: itself, or a multimodal checkpoint's `text_config`
  (model_type gemma3), with the storage dtype and tying of the whole checkpoint where the text
  config leaves them out."""
  if hf.get("model_type") != "gemma3":
    return hf
  text = hf.get("text_config")
  if text is None:
    text = {}  # transformers: Gemma3TextConfig's defaults
  if not isinstance(text, dict):
    raise HFFormatError(f"config.json text_config={text!r}: expected an object")
  inner = text.get("model_type", "gemma3_text")
  if inner != "gemma3_text":
    raise HFFormatError(f"config.json text_config.model_type={inner!r}: unsupported; a gemma3 "
                        f"checkpoint's text model is 'gemma3_text'")
  text = dict(text, model_type="gemma3_text")
  for key in ("dtype", "torch_dtype", "tie_word_embeddings", "quantization_config"):
    if key in hf and key not in text:
      text[key] = hf[key]
  return text


def defaults_of(family: Family) -> dict[str, Any]:
  """transformers' defaults for the optional fields of the family's config class."""
  return {**COMMON_DEFAULTS, **family.hf_defaults}


# --- sliding window ---------------------------------------------------------------------------


def _window_value(hf: dict, defaults: dict) -> int | None:
  """config.json's sliding_window: null means none (not the default), absent the default."""
  window = hf["sliding_window"] if "sliding_window" in hf else defaults.get("sliding_window")
  if window is None:
    return None
  if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
    raise HFFormatError(f"config.json sliding_window={window!r}: expected a positive integer "
                        f"or null")
  return window


def _hf_layer_types(hf: dict, num_layers: int) -> list[str] | None:
  types = hf.get("layer_types")
  if types is None:
    return None
  if not isinstance(types, list) or len(types) != num_layers:
    raise HFFormatError(f"config.json layer_types={types!r}: expected a list of "
                        f"num_hidden_layers={num_layers} layer types")
  for i, t in enumerate(types):
    if t not in HF_LAYER_TYPES:
      raise HFFormatError(f"config.json layer_types[{i}]={t!r}: unsupported; jaxtrain implements "
                          f"{', '.join(repr(k) for k in HF_LAYER_TYPES)}")
  return types


def pattern_layer_types(pattern: int, num_layers: int) -> list[str]:
  """Gemma 3's sliding_window_pattern: every `pattern`-th layer full, the others sliding."""
  return ["sliding_attention" if (i + 1) % pattern else "full_attention"
          for i in range(num_layers)]


def _sliding(hf: dict, family: Family, defaults: dict, num_layers: int
             ) -> tuple[int, str]:
  """(model.sliding_window, model.layer_types) as the family's config class reads its fields."""
  scheme = family.hf_window
  if scheme == "none":
    return 0, ""
  window = _window_value(hf, defaults)
  if scheme == "every":
    return (window or 0), ""
  if scheme == "all":  # Qwen3-MoE: use_sliding_window puts the window on every layer
    return (window or 0) if field(hf, "use_sliding_window", False) else 0, ""
  if scheme == "qwen":
    if not field(hf, "use_sliding_window", defaults["use_sliding_window"]):
      window = None  # Qwen2Config: no window unless use_sliding_window
    types = _hf_layer_types(hf, num_layers)
    if types is None:
      first = int(field(hf, "max_window_layers", defaults["max_window_layers"]))
      types = ["sliding_attention" if window is not None and i >= first else "full_attention"
               for i in range(num_layers)]
  else:  # "typed"
    types = _hf_layer_types(hf, num_layers)
    if types is None:
      pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern"))
      pattern = defaults["sliding_window_pattern"] if pattern is None else pattern
      if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise HFFormatError(f"config.json sliding_window_pattern={pattern!r}: expected a "
                            f"positive integer")
      types = pattern_layer_types(pattern, num_layers)
  sliding = [t == "sliding_attention" and window is not None for t in types]
  if not any(sliding):
    return 0, ""
  if all(sliding):
    return window, ""
  return window, ",".join(SLIDING if s else FULL for s in sliding)


# --- import -----------------------------------------------------------------------------------

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def is_sequence_classifier(hf: dict) -> bool:
  """Whether config.json's `architectures` names a *ForSequenceClassification (a reward model's
  checkpoint: a score head `score.weight` in place of `lm_head.weight`)."""
  architectures = hf.get("architectures") or []
  if isinstance(architectures, str):
    architectures = [architectures]
  return any(isinstance(a, str) and a.endswith(SEQUENCE_CLASSIFICATION) for a in architectures)


def num_labels(hf: dict) -> tuple[int, str]:
  """(the number of labels, the field it comes from) as transformers reads config.json: the length
  of `id2label` when given (what save_pretrained writes), else `num_labels`, else its default 2."""
  labels = hf.get("id2label")
  if isinstance(labels, dict):
    return len(labels), f"id2label ({len(labels)} labels)"
  value = hf.get("num_labels")
  if value is None:
    return 2, "num_labels (absent, with no id2label: transformers' default 2)"
  if isinstance(value, bool) or not isinstance(value, int):
    raise HFFormatError(f"config.json num_labels={value!r}: expected an integer (1 for a reward "
                        f"model)")
  return value, f"num_labels={value}"


def _check_score_head(hf: dict) -> bool:
  """Whether the checkpoint is a reward model (a score head); refuses a classifier of more than
  one label, which has no reward-model reading here."""
  if not is_sequence_classifier(hf):
    return False
  labels, where = num_labels(hf)
  if labels != 1:
    raise HFFormatError(f"config.json {where}: unsupported; jaxtrain imports a "
                        f"*ForSequenceClassification as a reward model, whose score head has "
                        f"num_labels=1 (one score per sequence)")
  return True


def _check_supported(hf: dict, family: Family, defaults: dict) -> None:
  """Refuses the fields that change the forward pass and that jaxtrain does not implement."""
  act_key = "hidden_activation" if "hidden_activation" in defaults else "hidden_act"
  want_act, mlp_name = HF_ACTIVATIONS[family.features.mlp_activation]
  act = field(hf, act_key, want_act)
  if act != want_act:
    raise HFFormatError(f"config.json {act_key}={act!r}: unsupported; jaxtrain's {family.name} "
                        f"MLP is {mlp_name} ({want_act!r})")
  if field(hf, "attention_bias", False) and not family.features.qkv_bias:
    raise HFFormatError(f"config.json attention_bias={hf['attention_bias']!r}: unsupported; "
                        f"jaxtrain's {family.name} attention has no bias (false)")
  if field(hf, "mlp_bias", False):
    raise HFFormatError(f"config.json mlp_bias={hf['mlp_bias']!r}: unsupported; jaxtrain's MLP "
                        f"has no bias (false)")
  for key in SOFTCAPPING_FIELDS:
    if hf.get(key) is not None:
      raise HFFormatError(f"config.json {key}={hf[key]!r}: unsupported; jaxtrain implements no "
                          f"logit softcapping (null)")
  if hf.get("use_bidirectional_attention"):
    raise HFFormatError(f"config.json use_bidirectional_attention="
                        f"{hf['use_bidirectional_attention']!r}: unsupported; jaxtrain's "
                        f"attention is causal (false)")
  quant = hf.get("quantization_config")
  if quant is not None:
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    raise HFFormatError(f"config.json quantization_config (quant_method {method!r}): "
                        f"unsupported; jaxtrain imports unquantized {', '.join(DTYPES)} weights")
  missing = [k for k in REQUIRED_FIELDS if hf.get(k) is None and k not in defaults]
  if missing:
    raise HFFormatError(f"config.json {missing[0]}: missing; a {family.name} config needs "
                        f"{', '.join(k for k in REQUIRED_FIELDS if k not in defaults)}")
  dtype = hf_dtype(hf)
  if dtype is not None and dtype not in DTYPES:
    raise HFFormatError(f"config.json dtype={dtype!r}: unsupported; expected one of "
                        f"{', '.join(DTYPES)}")


def hf_dtype(hf: dict) -> str | None:
  """The checkpoint's storage dtype as config.json names it ("dtype", or older "torch_dtype")."""
  hf = text_config(hf) if hf.get("model_type") == "gemma3" else hf
  dtype = hf.get("dtype", hf.get("torch_dtype"))
  return dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype


def model_overrides(hf: dict) -> dict[str, Any]:
  """{"model.KEY": value} for every model.* key a config.json determines.

  Raises HFFormatError naming the field and value for anything our decoder cannot reproduce.
  """
  family = family_of(hf)
  score_head = _check_score_head(hf)  # architectures and id2label sit at the top level
  hf = text_config(hf)
  defaults = defaults_of(family)
  _check_supported(hf, family, defaults)

  def get(key):
    return field(hf, key, defaults.get(key))

  heads = int(get("num_attention_heads"))
  hidden = int(get("hidden_size"))
  # Absent: the class default; null: as many as the query heads (what every class does).
  kv_heads = hf["num_key_value_heads"] if "num_key_value_heads" in hf else defaults.get(
      "num_key_value_heads")
  kv_heads = heads if kv_heads is None else int(kv_heads)
  num_layers = int(get("num_hidden_layers"))
  latent = ({} if "kv_lora_rank" not in defaults
            else hf_deepseek.latent_attention_overrides(hf, get, heads))
  head_dim = latent.get("model.head_dim", get("head_dim"))
  if head_dim is None:
    if hidden % heads:
      raise HFFormatError(f"config.json hidden_size={hidden}: not divisible by "
                          f"num_attention_heads={heads}, and no head_dim is given")
    head_dim = hidden // heads
  if heads % kv_heads:
    raise HFFormatError(f"config.json num_key_value_heads={kv_heads}: does not divide "
                        f"num_attention_heads={heads}")
  if int(head_dim) % 2:
    raise HFFormatError(f"config.json head_dim={head_dim}: must be even for rotary embeddings")
  max_positions = int(get("max_position_embeddings"))
  theta, scaling, local_theta = rope_of(hf, family, defaults, max_positions)
  window, layer_types = _sliding(hf, family, defaults, num_layers)
  query_scalar = 0.0
  if "query_pre_attn_scalar" in defaults:
    query_scalar = float(get("query_pre_attn_scalar"))
    if query_scalar <= 0:
      raise HFFormatError(f"config.json query_pre_attn_scalar={query_scalar}: must be positive")
  out = {
      "model.family": family.name,
      "model.vocab_size": int(get("vocab_size")),
      "model.num_layers": num_layers,
      "model.d_model": hidden,
      "model.num_heads": heads,
      "model.num_kv_heads": kv_heads,
      "model.head_dim": int(head_dim),
      "model.mlp_dim": int(get("intermediate_size")),
      "model.norm_eps": float(get("rms_norm_eps")),
      "model.rope_theta": theta,
      "model.rope_scaling.type": scaling["type"] if scaling else "none",
      "model.max_position_embeddings": max_positions,
      "model.tie_embeddings": bool(get("tie_word_embeddings")),
      "model.init_std": float(get("initializer_range")),
      "model.sliding_window": window,
      "model.layer_types": layer_types,
      "model.local_rope_theta": local_theta,
      "model.query_pre_attn_scalar": query_scalar,
  }
  if score_head:  # a reward model: score.weight in place of the vocabulary head
    out["model.score_head"] = True
  out.update(latent)
  out.update(_moe_overrides(hf, family, defaults, num_layers))
  for key, value in (scaling or {}).items():
    if key != "type":  # the scaling's own fields, as model.rope_scaling names them too
      kind = int if key == "original_max_position_embeddings" else float
      out[f"model.rope_scaling.{key}"] = kind(value)
  return out


# Routing fields of other MoE designs: (field, the value that means our softmax top-k router).
UNSUPPORTED_ROUTING = (("scoring_func", "softmax"), ("topk_method", "greedy"),
                       ("n_shared_experts", 0), ("shared_expert_intermediate_size", 0),
                       ("n_group", 1), ("routed_scaling_factor", 1.0),
                       ("router_jitter_noise", 0.0))


def _moe_overrides(hf: dict, family: Family, defaults: dict, num_layers: int) -> dict[str, Any]:
  """moe.* of an MoE family's config.json; refuses routing our router does not implement."""
  names = family.hf_experts
  if names is None:
    return {}
  deepseek = bool(names.router_bias)  # DeepSeek's router (interop/hf_deepseek.py)
  for key, ours in () if deepseek else UNSUPPORTED_ROUTING:
    value = hf.get(key)
    if value is not None and value != ours and not (isinstance(ours, float) and value == 0):
      raise HFFormatError(f"config.json {key}={value!r}: unsupported routing; jaxtrain's "
                          f"{family.name} router is a softmax over the experts then the top k "
                          f"({key}={ours!r})")
  get = lambda key: field(hf, key, defaults.get(key))  # noqa: E731
  # transformers 5 saves Qwen3-MoE's num_experts under Mixtral's name, num_local_experts.
  experts = next((hf[k] for k in (names.num_experts_key, "num_local_experts") if k in hf),
                 defaults.get(names.num_experts_key))
  experts, top_k = int(experts), int(get("num_experts_per_tok"))
  if not 1 <= top_k <= experts:
    raise HFFormatError(f"config.json num_experts_per_tok={top_k}: must be between 1 and the "
                        f"{experts} experts")
  dense = (list(range(int(get("first_k_dense_replace") or 0))) if deepseek
           else get("mlp_only_layers") or [])
  if any(not isinstance(i, int) or not 0 <= i < num_layers for i in dense):
    raise HFFormatError(f"config.json mlp_only_layers={dense!r}: expected layer indices below "
                        f"num_hidden_layers={num_layers}")
  step = int(get("decoder_sparse_step") or 1)
  moe = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
  if not any(moe):
    raise HFFormatError(f"config.json mlp_only_layers={dense!r}, decoder_sparse_step={step}: "
                        f"no MoE layer among {num_layers}; convert it as a dense model")
  first = moe.index(True)
  # Scanned layers stack one structure per stack: a dense prefix and the MoE rest at most.
  scannable = {} if all(moe[first:]) else {"model.scan_layers": False}
  out = {**scannable}
  if hf.get("router_aux_loss_coef") is not None:
    # transformers' load-balancing loss is k times ours (models/moe.py): the same weight in
    # the objective is k times its coefficient.
    out["moe.aux_loss_coef"] = float(hf["router_aux_loss_coef"]) * top_k
  if deepseek:
    out.update(hf_deepseek.routing_overrides(hf, get, experts, num_layers))
  return {
      **out,
      "moe.num_experts": experts,
      "moe.experts_per_token": top_k,
      "moe.expert_mlp_dim": int(get(names.expert_mlp_key)),
      # Mixtral always renormalizes (its config has no switch).
      "moe.norm_topk_prob": bool(get("norm_topk_prob")) if "norm_topk_prob" in defaults
                            else True,
      "moe.dense_layers": ",".join(str(i) for i in dense),
      "moe.sparse_step": step,
      **out,
  }


def tokenizer_path(directory: str) -> str | None:
  path = os.path.join(os.path.abspath(directory), "tokenizer.json")
  return path if os.path.isfile(path) else None


def overrides_for(hf: dict, directory: str, param_dtype: str) -> dict[str, Any]:
  """Every config key an imported model sets: model.*, the param dtype, a train.seq_len the
  model's positions allow, and data.tokenizer when the directory ships a tokenizer.json. A
  reward model (model.score_head) also sets the objective that trains it and its data format."""
  if param_dtype not in DTYPES:
    raise HFFormatError(f"dtype={param_dtype!r}: choose one of {', '.join(DTYPES)}")
  out = model_overrides(hf)
  if out.get("model.score_head"):
    out["train.objective"] = "reward"
    out["data.format"] = "preference"
  out["model.param_dtype"] = param_dtype
  seq_len = default_config().train.seq_len
  if out["model.max_position_embeddings"] < seq_len:
    out["train.seq_len"] = out["model.max_position_embeddings"]
  tok = tokenizer_path(directory)
  if tok:
    out["data.tokenizer"] = "hf:" + tok
  return out


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> None:
  for key, value in overrides.items():
    *groups, name = key.split(".")
    node = config
    for g in groups:
      node = node[g]
    setattr(node, name, value)


def to_jaxtrain_config(hf: dict, directory: str,
                       param_dtype: str = "float32") -> ml_collections.ConfigDict:
  """default_config() with everything the Hugging Face config determines filled in."""
  config = default_config()
  apply_overrides(config, overrides_for(hf, directory, param_dtype))
  return config
