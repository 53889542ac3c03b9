"""What a model family changes in the shared decoder: one switch per difference.

Every difference between the families this package trains is implemented once, in
models/layers.py or models/decoder.py, and chosen by one of these fields. A family module
(models/llama.py, qwen3.py, ...) is a `Family` record naming its switches, what Hugging Face
calls it, and which projections LoRA may adapt. Numbers a config.json gives (sliding window,
layer types, RoPE bases, softmax scale) are architecture fields (models/config.py), not switches.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jaxtrain.config import LORA_TARGETS  # every projection that can carry an adapter

MLP_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class Features:
  """The decoder's switches. The defaults are Llama: every other family is a few changes."""
  # RMSNorm over each head's queries and keys after the projections, before RoPE (Qwen3, Gemma 3).
  qk_norm: bool = False
  # Biases on the q, k and v projections (Qwen2.5); o and the MLP stay without.
  qkv_bias: bool = False
  # RMSNorm multiplies by (1 + w) instead of w, with w stored as the checkpoint stores it
  # (Gemma): zero-initialized scales start as the identity.
  norm_plus_one: bool = False
  # Four norms per layer: before and after attention, before and after the MLP; the outputs of
  # both sublayers are normed before the residual add (Gemma 3).
  sandwich_norms: bool = False
  # Embeddings multiplied by sqrt(D) (rounded to the compute dtype, as the reference does) before
  # the first layer (Gemma).
  scale_embeddings: bool = False
  # The gated MLP's nonlinearity: SwiGLU's silu, or GeGLU's tanh-approximated GELU (Gemma).
  mlp_activation: str = "silu"


@dataclasses.dataclass(frozen=True)
class ExpertNames:
  """Where a Mixture-of-Experts family's checkpoint keeps an MoE layer's tensors, under
  model.layers.{i}.: `{block}.{router}.weight` [X, D] and, per expert j,
  `{block}.experts.{j}.{gate|up|down}.weight`; and the config.json keys of the expert count and
  each expert's hidden size."""
  block: str
  router: str
  gate: str
  up: str
  down: str
  num_experts_key: str
  expert_mlp_key: str
  # DeepSeek's: the router's correction bias `{block}.{router}.{router_bias}` [X], and the
  # shared experts' gated MLP `{block}.{shared}.{gate,up,down}_proj`; "" where there are none.
  router_bias: str = ""
  shared: str = ""


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: its switches and its names on the Hugging Face side."""
  name: str
  features: Features
  # config.json `model_type` values this family imports (the first is what export writes).
  hf_model_types: tuple[str, ...]
  # The class export names in config.json `architectures`.
  hf_architecture: str
  # transformers' defaults for optional config.json fields of this family (its config class's),
  # so a sparse file means here what it means there.
  hf_defaults: Mapping[str, object]
  # How its config class marks the layers that attend within `sliding_window`: "none" (no window
  # at all), "every" (every layer; null: none), "qwen" (`use_sliding_window`, then `layer_types`
  # or the layers from `max_window_layers` on), "all" (`use_sliding_window`: every layer),
  # "typed" (`layer_types`, else `sliding_window_pattern`: every Nth layer full).
  hf_window: str = "none"
  # Fixed fields export writes, as save_pretrained writes them for the family.
  hf_export_fields: Mapping[str, object] = dataclasses.field(default_factory=dict)
  lora_targets: tuple[str, ...] = LORA_TARGETS
  # What the family's docs say in one line (the run table, docs/models.md).
  summary: str = ""
  # A Mixture-of-Experts family (its models have moe.num_experts > 0): its checkpoint names.
  hf_experts: ExpertNames | None = None
  # Whether its models may have multi-token-prediction modules (model.mtp_depth > 0).
  multi_token_prediction: bool = False
