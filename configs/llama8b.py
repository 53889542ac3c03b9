"""Llama 3.1 / 3.3 8B: 8.03B parameters, untied embeddings, llama3 RoPE scaling x8.

Architecture as published; batch size and mesh (fsdp over all devices) are a starting point for
accelerators. Override on the command line, e.g. --config.mesh.tensor=8.
"""

from jaxtrain.config import llama3_config


def get_config():
  return llama3_config(num_layers=32, d_model=4096, num_heads=32, head_dim=128, mlp_dim=14336,
                       tie_embeddings=False, rope_factor=8.0, global_batch_size=256,
                       target="h100x8")
