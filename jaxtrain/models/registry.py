"""The model families by name: adding one is a module beside this one and an entry here."""

from __future__ import annotations

from jaxtrain.models import (deepseek_v3, gemma3, llama, mistral, mixtral, qwen2, qwen3,
                             qwen3_moe)
from jaxtrain.models.features import Family

FAMILIES: dict[str, Family] = {f.FAMILY.name: f.FAMILY
                               for f in (llama, qwen3, qwen2, mistral, gemma3, mixtral, qwen3_moe,
                                           deepseek_v3)}
NAMES = tuple(FAMILIES)


def get(name: str) -> Family:
  """The family called `name`; ValueError naming the known ones otherwise."""
  try:
    return FAMILIES[name]
  except KeyError:
    raise ValueError(f"model.family={name!r}: unknown; choose one of {', '.join(NAMES)}") from None


def for_hf_model_type(model_type) -> Family | None:
  """The family that imports config.json's `model_type`, or None."""
  for family in FAMILIES.values():
    if model_type in family.hf_model_types:
      return family
  return None


def hf_model_types() -> tuple[str, ...]:
  return tuple(t for f in FAMILIES.values() for t in f.hf_model_types)
