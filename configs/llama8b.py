"""Llama 3.1 / 3.3 8B: 8.03B parameters, untied embeddings, llama3 RoPE scaling x8.

Target: one 8-GPU H100 host (h100x8), where most 8B pre-training and fine-tuning runs live;
fsdp over its 8 GPUs. Global batch 256 x 8192 tokens (2M tokens per step) as 16 microbatches of
2 sequences per GPU, remat `minimal`: 63.9 GiB of the H100's 79.1 GiB by the exact compile
(microbatch 1: 44.3 GiB; 32, without accumulation: 717 GiB).

Architecture as published. Override on the command line, e.g. --config.mesh.tensor=8, or
--config.target=... with --dry_run to size it for other hardware.
"""

from jaxtrain.config import llama3_config


def get_config():
  c = llama3_config(num_layers=32, d_model=4096, num_heads=32, head_dim=128, mlp_dim=14336,
                    tie_embeddings=False, rope_factor=8.0, global_batch_size=256,
                    target="h100x8")
  c.train.grad_accum_steps = 16  # microbatch 2 per GPU
  return c
