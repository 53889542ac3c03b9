"""LoRA and QLoRA: adapters on chosen projections over a frozen, optionally quantized, base.

  lora.py   Adapter (the trainable variable type), the LoRA modules, the config checks: what
            the model's layers are built with
  state.py  what the trainer needs: trainable_filter, frozen_from_base, heads_from_base,
            merged_params, plain_config, parameter_counts, check_mesh

The quantized storage of the base (int8 / int4 / nf4) and the projection that dequantizes it
and adds the adapter are numerical ops: `jaxtrain/ops/quantize.py`, `jaxtrain/ops/projection.py`.
This package and `models/` form one layer: the layers hold adapters, and state.py reads the
model (docs/architecture.md). See docs/finetuning.md (LoRA and QLoRA).
"""
