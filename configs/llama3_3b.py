"""Llama 3.2 3B: 3.21B parameters, tied embeddings, llama3 RoPE scaling x32.

Target: one 8-GPU H100 host (h100x8); fsdp over its 8 GPUs. Global batch 128 x 8192 tokens
as 4 microbatches of 4 sequences per GPU: 59.5 GiB of the H100's 79.1 GiB by the exact compile.

Architecture as published. Override on the command line, e.g. --config.mesh.tensor=8, or
--config.target=... with --dry_run to size it for other hardware.
"""

from jaxtrain.config import llama3_config


def get_config():
  c = llama3_config(num_layers=28, d_model=3072, num_heads=24, head_dim=128, mlp_dim=8192,
                    tie_embeddings=True, rope_factor=32.0, global_batch_size=128,
                    target="h100x8")
  c.train.grad_accum_steps = 4  # microbatch 4 per GPU
  return c
