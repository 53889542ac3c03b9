"""LoRA and QLoRA: adapters on chosen projections over a frozen, optionally quantized, base.

  lora.py      Adapter (the trainable variable type), the LoRA module, config checks
  quantize.py  int8 / int4 / nf4 storage with per-group scales, packing, QuantizedWeight
  projection.py one projection: (dequantized) base matmul + adapter, as the model calls it
  state.py     what the trainer needs: trainable_filter, frozen_from_base, heads_from_base,
               merged_params, plain_config, parameter_counts, check_mesh

See docs/finetuning.md (LoRA and QLoRA).
"""

from jaxtrain.peft.lora import Adapter, LoRA, adapter, check_config
from jaxtrain.peft.projection import dense, project, weight_value
# (The functions quantize/dequantize stay in their module: `jaxtrain.peft.quantize` is the module.)
from jaxtrain.peft.quantize import Quantized, QuantizedWeight
from jaxtrain.peft.state import (ParameterCounts, check_mesh, frozen_from_base, heads_from_base,
                                 merged_params, parameter_counts, plain_config, trainable_filter)

__all__ = [
    "Adapter", "LoRA", "adapter", "check_config", "dense", "project", "weight_value", "Quantized",
    "QuantizedWeight", "ParameterCounts", "check_mesh",
    "frozen_from_base", "heads_from_base", "merged_params", "parameter_counts", "plain_config",
    "trainable_filter",
]
