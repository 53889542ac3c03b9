"""Llama 3.1 405B: 405.85B parameters, untied embeddings, llama3 RoPE scaling x8.

Target: 32 hosts of 8 H100s (h100x256); fsdp over all 256 GPUs, which leaves each 5.9 GiB of
float32 weights. Global batch 1024 x 8192 tokens as 4 microbatches of 1 sequence per GPU, full
remat and bfloat16 Adam moments: 66.9 GiB of the H100's 79.1 GiB by the exact compile (float32
moments: 72.9 GiB, under the 10% headroom). The same settings fit a v5p-512 slice (256 chips
of 95.7 GiB) too: 78.1 GiB per chip (`--dry_run --dry_run_target=v5p-512`).

Architecture as published. Override on the command line, e.g. --config.mesh.tensor=8, or
--config.target=... with --dry_run to size it for other hardware.
"""

from jaxtrain.config import llama3_config


def get_config():
  c = llama3_config(num_layers=126, d_model=16384, num_heads=128, head_dim=128, mlp_dim=53248,
                    tie_embeddings=False, rope_factor=8.0, global_batch_size=1024,
                    target="h100x256")
  c.train.grad_accum_steps = 4  # microbatch 1 per GPU
  c.model.remat_policy = "full"
  c.optim.state_dtype = "bfloat16"  # -5.9 GiB per GPU
  return c
