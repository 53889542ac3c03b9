"""Llama 3.1 / 3.3 70B: 70.55B parameters, untied embeddings, llama3 RoPE scaling x8.

Architecture as published; batch size and mesh (fsdp over all devices) are a starting point for
accelerators. Override on the command line, e.g. --config.mesh.tensor=8.
"""

from jaxtrain.config import llama3_config


def get_config():
  return llama3_config(num_layers=80, d_model=8192, num_heads=64, head_dim=128, mlp_dim=28672,
                       tie_embeddings=False, rope_factor=8.0, global_batch_size=512,
                       target="h100x64")
