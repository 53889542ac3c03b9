"""Llama 3.2 3B: 3.21B parameters, tied embeddings, llama3 RoPE scaling x32.

Architecture as published; batch size and mesh (fsdp over all devices) are a starting point for
accelerators. Override on the command line, e.g. --config.mesh.tensor=8.
"""

from jaxtrain.config import llama3_config


def get_config():
  return llama3_config(num_layers=28, d_model=3072, num_heads=24, head_dim=128, mlp_dim=8192,
                       tie_embeddings=True, rope_factor=32.0, global_batch_size=128,
                       target="h100x8")
