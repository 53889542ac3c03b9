"""config.json's RoPE, in both spellings (hf_config.py's module docstring shows them): the base,
the scaling (llama3, linear, yarn) and Gemma 3's per-layer-type entries, with one-line
refusals for what jaxtrain does not implement."""

from __future__ import annotations

from typing import Any

from jaxtrain.interop.hf_errors import HFFormatError
from jaxtrain.models import registry
from jaxtrain.models.config import FULL, SLIDING
from jaxtrain.models.features import Family
from jaxtrain.models.rope import YARN_KEYS

HF_DEFAULT_ROPE_THETA = 10000.0
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")
# What a YaRN entry leaves out takes transformers' default (the original length:
# max_position_embeddings; mscales unset).
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}
ROPE_TYPES = ("default", "llama3", "linear", "yarn")
# Hugging Face layer types <-> ours.
HF_LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}


def field(hf: dict, key: str, default: Any = None) -> Any:
  """hf[key], the default when absent or null (transformers treats null as unset)."""
  value = hf.get(key)
  return default if value is None else value


def _rope_without_theta(params) -> dict | None:
  """A RoPE dict compared across spellings: "type" read as "rope_type", theta aside."""
  if not isinstance(params, dict):
    return params
  out = {("rope_type" if k == "type" else k): v for k, v in params.items() if k != "rope_theta"}
  out.setdefault("rope_type", "default")
  return out


def _check_partial(value) -> None:
  if value is not None and float(value) != 1.0:
    raise HFFormatError(f"config.json partial_rotary_factor={value}: unsupported; jaxtrain "
                        f"rotates the whole head dim (1.0)")


def _rope_entry(params: dict, where: str, theta: float, max_positions: int
                ) -> tuple[float, dict[str, Any] | None]:
  """(theta, scaling dict with "type", or None) of one RoPE dict; `where` names it."""
  if not isinstance(params, dict):
    raise HFFormatError(f"config.json {where}={params!r}: expected an object")
  theta = params.get("rope_theta", theta)
  rope_type = params.get("rope_type", params.get("type", "default"))
  _check_partial(params.get("partial_rotary_factor"))
  if rope_type == "default":
    return float(theta), None
  if rope_type not in ROPE_TYPES:
    raise HFFormatError(f"config.json {where}.rope_type={rope_type!r}: unsupported; jaxtrain "
                        f"implements {', '.join(repr(t) for t in ROPE_TYPES)} RoPE")
  keys = {"llama3": LLAMA3_KEYS, "yarn": YARN_KEYS}.get(rope_type, ("factor",))
  scaling = {"type": rope_type}
  if rope_type == "yarn":
    _check_yarn_extras(params, where)
  for key in keys:
    value = params.get(key)
    if value is None and key == "original_max_position_embeddings":
      value = max_positions  # what transformers assumes when a config leaves it out
    if value is None and rope_type == "yarn":
      value = YARN_DEFAULTS.get(key)
    if value is None:
      raise HFFormatError(f"config.json {where}.{key}: missing; {rope_type} RoPE needs "
                          f"{', '.join(keys)}")
    scaling[key] = value
  if float(scaling["factor"]) <= 0:
    raise HFFormatError(f"config.json {where}.factor={scaling['factor']}: must be positive")
  return float(theta), scaling


def _check_yarn_extras(params: dict, where: str) -> None:
  """YaRN fields jaxtrain does not implement: refused rather than dropped."""
  for key, unset in (("attention_factor", None), ("truncate", True)):
    if params.get(key, unset) != unset:
      raise HFFormatError(f"config.json {where}.{key}={params[key]!r}: unsupported; jaxtrain's "
                          f"YaRN derives the attention factor from mscale and rounds the ramp's "
                          f"ends outward (truncate=true)")


def rope_of(hf: dict, family: Family, defaults: dict, max_positions: int
          ) -> tuple[float, dict[str, Any] | None, float]:
  """(theta, scaling or None, local theta or 0) from either spelling."""
  _check_partial(hf.get("partial_rotary_factor"))
  params, spelling = hf.get("rope_parameters"), "rope_parameters"
  legacy = hf.get("rope_scaling")
  per_type = "rope_local_base_freq" in defaults  # Gemma 3: a RoPE per layer type
  if params is not None and not isinstance(params, dict):
    raise HFFormatError(f"config.json rope_parameters={params!r}: expected an object")
  if legacy is not None and not isinstance(legacy, dict):
    raise HFFormatError(f"config.json rope_scaling={legacy!r}: expected an object")
  nested = params is not None and any(isinstance(v, dict) for v in params.values())
  theta = field(hf, "rope_theta", defaults.get("rope_theta", HF_DEFAULT_ROPE_THETA))
  if not per_type:
    if nested:
      typed = [f.name for f in registry.FAMILIES.values()
               if "rope_local_base_freq" in f.hf_defaults]
      raise HFFormatError(f"config.json rope_parameters={params!r}: RoPE parameters per layer "
                          f"type are not a {family.name} feature; jaxtrain reads them for "
                          f"{', '.join(typed)}")
    if params is None:
      params, spelling = legacy, "rope_scaling"
    elif legacy is not None and _rope_without_theta(legacy) != _rope_without_theta(params):
      # transformers 5 would let rope_scaling win; a file saying two things is better refused.
      raise HFFormatError(f"config.json rope_scaling={legacy!r} and rope_parameters={params!r}: "
                          f"they disagree; keep one of them")
    theta, scaling = _rope_entry(params or {}, spelling, theta, max_positions)
    return theta, scaling, 0.0
  # Gemma 3, as Gemma3TextConfig.convert_rope_params_to_dict reads it.
  if params is not None:
    unknown = sorted(set(params) - set(HF_LAYER_TYPES))
    if unknown or not nested:
      raise HFFormatError(f"config.json rope_parameters={params!r}: {family.name} expects one "
                          f"entry per layer type ({', '.join(HF_LAYER_TYPES)})")
  params = params or {}
  full = params.get("full_attention") or {}
  if legacy is not None:
    if params.get("full_attention") and (_rope_without_theta(legacy)
                                         != _rope_without_theta(full)):
      raise HFFormatError(f"config.json rope_scaling={legacy!r} and "
                          f"rope_parameters.full_attention={full!r}: they disagree; keep one of "
                          f"them")
    full = {**full, **legacy}
  where = "rope_parameters.full_attention" if params.get("full_attention") else "rope_scaling"
  theta, scaling = _rope_entry(full, where, theta, max_positions)
  local = field(hf, "rope_local_base_freq", defaults["rope_local_base_freq"])
  local, local_scaling = _rope_entry(params.get("sliding_attention") or {},
                                     "rope_parameters.sliding_attention", local, max_positions)
  if local_scaling is not None:
    raise HFFormatError(f"config.json rope_parameters.sliding_attention.rope_type="
                        f"{local_scaling['type']!r}: unsupported; jaxtrain's sliding layers use "
                        f"plain RoPE ('default')")
  return theta, scaling, local
