"""Llama 3.2 1B: 1.24B parameters, tied embeddings, llama3 RoPE scaling x32.

Target: one 8-GPU H100 host (h100x8), the smallest common multi-GPU node; fsdp over its 8 GPUs.
Global batch 128 x 8192 tokens (1M tokens per step) as 2 microbatches of 8 sequences per GPU:
the exact compile (`--dry_run`, XLA's GPU compiler) needs 56.7 GiB of the H100's 79.1 GiB.

Architecture as published. Override on the command line, e.g. --config.mesh.tensor=8, or
--config.target=... with --dry_run to size it for other hardware.
"""

from jaxtrain.config import llama3_config


def get_config():
  c = llama3_config(num_layers=16, d_model=2048, num_heads=32, head_dim=64, mlp_dim=8192,
                    tie_embeddings=True, rope_factor=32.0, global_batch_size=128,
                    target="h100x8")
  c.train.grad_accum_steps = 2  # microbatch 8 per GPU; 16 would need 107 GiB
  return c
