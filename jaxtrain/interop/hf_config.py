"""Hugging Face Llama `config.json` <-> jaxtrain config, in both directions, with clear refusals.

Import reads every field that changes the forward pass and refuses what our model cannot run
(biases, another activation, RoPE types other than plain and llama3, another architecture)
rather than converting into a model that silently computes something else. RoPE parameters come
in two spellings, both read here:

  transformers >= 5:  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
  older files:        "rope_theta": 500000.0,
                      "rope_scaling": {"rope_type" (or "type"): "llama3", "factor": 8.0, ...}

Export writes the transformers >= 5 spelling by default (what `save_pretrained` writes today) or
the older one on request, for readers older than transformers 5, which ignore `rope_parameters`.
Defaults for absent optional fields are transformers' `LlamaConfig` defaults, so a sparse file
means here what it means there.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from jaxtrain.config import ConfigError, default_config

# transformers' LlamaConfig defaults for optional fields.
HF_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
}
HF_DEFAULT_ROPE_THETA = 10000.0
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")
# Our dtype names <-> the names config.json uses (torch's, without the "torch." prefix).
DTYPES = ("float32", "bfloat16", "float16")
ROPE_SPELLINGS = ("rope_parameters", "rope_scaling")


class HFFormatError(ConfigError):
  """A Hugging Face directory or config that cannot be converted; one line naming what and why."""


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


def _field(hf: dict, key: str, default: Any = None) -> Any:
  """hf[key], the default when absent or null (transformers treats null as unset)."""
  value = hf.get(key)
  return default if value is None else value


def _rope(hf: dict) -> tuple[float, dict[str, Any] | None]:
  """(theta, llama3 scaling dict or None) from either spelling."""
  params, spelling = hf.get("rope_parameters"), "rope_parameters"
  legacy = hf.get("rope_scaling")
  if params is None:
    params, spelling = legacy, "rope_scaling"
  elif legacy is not None and _rope_without_theta(legacy) != _rope_without_theta(params):
    # transformers 5 would let rope_scaling win; a file saying two things is better refused.
    raise HFFormatError(f"config.json rope_scaling={legacy!r} and rope_parameters={params!r}: "
                        f"they disagree; keep one of them")
  if params is not None and not isinstance(params, dict):
    raise HFFormatError(f"config.json {spelling}={params!r}: expected an object")
  params = params or {}
  if any(isinstance(v, dict) for v in params.values()):
    raise HFFormatError(f"config.json {spelling}={params!r}: RoPE parameters per layer type are "
                        f"not a Llama feature; jaxtrain uses one RoPE for all layers")
  theta = params.get("rope_theta", _field(hf, "rope_theta", HF_DEFAULT_ROPE_THETA))
  rope_type = params.get("rope_type", params.get("type", "default"))
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
  if partial is not None and float(partial) != 1.0:
    raise HFFormatError(f"config.json partial_rotary_factor={partial}: unsupported; jaxtrain "
                        f"rotates the whole head dim (1.0)")
  if rope_type == "default":
    return float(theta), None
  if rope_type != "llama3":
    raise HFFormatError(f"config.json {spelling}.rope_type={rope_type!r}: unsupported; jaxtrain "
                        f"implements 'default' and 'llama3' RoPE")
  scaling = {}
  for key in LLAMA3_KEYS:
    value = params.get(key)
    if value is None and key == "original_max_position_embeddings":
      # What transformers assumes when a llama3 config leaves it out.
      value = _field(hf, "max_position_embeddings", HF_DEFAULTS["max_position_embeddings"])
    if value is None:
      raise HFFormatError(f"config.json {spelling}.{key}: missing; llama3 RoPE needs "
                          f"{', '.join(LLAMA3_KEYS)}")
    scaling[key] = value
  return float(theta), scaling


def _rope_without_theta(params) -> dict | None:
  """A RoPE dict compared across spellings: "type" read as "rope_type", theta aside."""
  if not isinstance(params, dict):
    return params
  out = {("rope_type" if k == "type" else k): v for k, v in params.items() if k != "rope_theta"}
  out.setdefault("rope_type", "default")
  return out


def _check_supported(hf: dict) -> None:
  model_type = hf.get("model_type")
  if model_type != "llama":
    raise HFFormatError(f"config.json model_type={model_type!r}: unsupported; jaxtrain imports "
                        f"Llama models (model_type 'llama')")
  act = _field(hf, "hidden_act", HF_DEFAULTS["hidden_act"])
  if act != "silu":
    raise HFFormatError(f"config.json hidden_act={act!r}: unsupported; jaxtrain's MLP is SwiGLU "
                        f"('silu')")
  for key in ("attention_bias", "mlp_bias"):
    if _field(hf, key, False):
      raise HFFormatError(f"config.json {key}={hf[key]!r}: unsupported; jaxtrain's projections "
                          f"have no bias")
  missing = [k for k in REQUIRED_FIELDS if hf.get(k) is None]
  if missing:
    raise HFFormatError(f"config.json {missing[0]}: missing; a Llama config needs "
                        f"{', '.join(REQUIRED_FIELDS)}")
  dtype = hf_dtype(hf)
  if dtype is not None and dtype not in DTYPES:
    raise HFFormatError(f"config.json dtype={dtype!r}: unsupported; expected one of "
                        f"{', '.join(DTYPES)}")


def hf_dtype(hf: dict) -> str | None:
  """The checkpoint's storage dtype as config.json names it ("dtype", or older "torch_dtype")."""
  dtype = hf.get("dtype", hf.get("torch_dtype"))
  return dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype


def model_overrides(hf: dict) -> dict[str, Any]:
  """{"model.KEY": value} for every model.* key a config.json determines.

  Raises HFFormatError naming the field and value for anything our Llama cannot reproduce.
  """
  _check_supported(hf)
  heads = int(hf["num_attention_heads"])
  hidden = int(hf["hidden_size"])
  kv_heads = int(_field(hf, "num_key_value_heads", heads))
  head_dim = hf.get("head_dim")
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
  theta, scaling = _rope(hf)
  out = {
      "model.vocab_size": int(hf["vocab_size"]),
      "model.num_layers": int(hf["num_hidden_layers"]),
      "model.d_model": hidden,
      "model.num_heads": heads,
      "model.num_kv_heads": kv_heads,
      "model.head_dim": int(head_dim),
      "model.mlp_dim": int(hf["intermediate_size"]),
      "model.norm_eps": float(_field(hf, "rms_norm_eps", HF_DEFAULTS["rms_norm_eps"])),
      "model.rope_theta": theta,
      "model.rope_scaling.type": "llama3" if scaling else "none",
      "model.max_position_embeddings": int(_field(hf, "max_position_embeddings",
                                                  HF_DEFAULTS["max_position_embeddings"])),
      "model.tie_embeddings": bool(_field(hf, "tie_word_embeddings",
                                          HF_DEFAULTS["tie_word_embeddings"])),
      "model.init_std": float(_field(hf, "initializer_range", HF_DEFAULTS["initializer_range"])),
  }
  if scaling:
    out["model.rope_scaling.factor"] = float(scaling["factor"])
    out["model.rope_scaling.low_freq_factor"] = float(scaling["low_freq_factor"])
    out["model.rope_scaling.high_freq_factor"] = float(scaling["high_freq_factor"])
    out["model.rope_scaling.original_max_position_embeddings"] = int(
        scaling["original_max_position_embeddings"])
  return out


def tokenizer_path(directory: str) -> str | None:
  path = os.path.join(os.path.abspath(directory), "tokenizer.json")
  return path if os.path.isfile(path) else None


def overrides_for(hf: dict, directory: str, param_dtype: str) -> dict[str, Any]:
  """Every config key an imported model sets: model.*, the param dtype, a train.seq_len the
  model's positions allow, and data.tokenizer when the directory ships a tokenizer.json."""
  if param_dtype not in DTYPES:
    raise HFFormatError(f"dtype={param_dtype!r}: choose one of {', '.join(DTYPES)}")
  out = model_overrides(hf)
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


def from_jaxtrain_config(config, *, dtype: str, bos_id: int | None = None,
                         eos_id: int | None = None,
                         rope_spelling: str = "rope_parameters") -> dict[str, Any]:
  """A transformers-loadable LlamaForCausalLM config.json (as a dict) for `config.model`."""
  m = config.model
  if dtype not in DTYPES:
    raise HFFormatError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
  if rope_spelling not in ROPE_SPELLINGS:
    raise HFFormatError(f"rope_spelling={rope_spelling!r}: choose one of "
                        f"{', '.join(ROPE_SPELLINGS)}")
  if m.d_model % m.num_heads:
    # transformers' LlamaConfig validation refuses this even when head_dim is given.
    raise HFFormatError(f"model.d_model={m.d_model}: transformers requires hidden_size to be "
                        f"divisible by num_attention_heads={m.num_heads}")
  rope: dict[str, Any] = {"rope_type": "default"}
  if m.rope_scaling.type == "llama3":
    rs = m.rope_scaling
    rope = {"rope_type": "llama3", "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": int(rs.original_max_position_embeddings)}
  hf = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": int(m.vocab_size),
      "hidden_size": int(m.d_model),
      "intermediate_size": int(m.mlp_dim),
      "num_hidden_layers": int(m.num_layers),
      "num_attention_heads": int(m.num_heads),
      "num_key_value_heads": int(m.num_kv_heads),
      "head_dim": int(m.head_dim),
      "hidden_act": "silu",
      "max_position_embeddings": int(m.max_position_embeddings),
      "initializer_range": float(m.init_std),
      "rms_norm_eps": float(m.norm_eps),
      "tie_word_embeddings": bool(m.tie_embeddings),
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "pretraining_tp": 1,
      "use_cache": True,
      "bos_token_id": bos_id,
      "eos_token_id": eos_id,
      "pad_token_id": None,
  }
  if rope_spelling == "rope_parameters":
    hf["rope_parameters"] = {**rope, "rope_theta": float(m.rope_theta)}
    hf["dtype"] = dtype
  else:
    hf["rope_theta"] = float(m.rope_theta)
    hf["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    hf["torch_dtype"] = dtype
  return hf
