"""Llama 3.1 / 3.3 70B: 70.55B parameters, untied embeddings, llama3 RoPE scaling x8.

Target: 8 hosts of 8 H100s (h100x64), a common size for 70B training; fsdp over all 64 GPUs
(1.1 GiB of float32 weights and 2.2 GiB of Adam moments per GPU per 16 layers). Global batch
512 x 8192 tokens as 4 microbatches of 2 sequences per GPU with full remat: 51.0 GiB of the
H100's 79.1 GiB by the exact compile (remat `minimal` would need 127 GiB at microbatch 1).

Architecture as published. Override on the command line, e.g. --config.mesh.tensor=8, or
--config.target=... with --dry_run to size it for other hardware.
"""

from jaxtrain.config import llama3_config


def get_config():
  c = llama3_config(num_layers=80, d_model=8192, num_heads=64, head_dim=128, mlp_dim=28672,
                    tie_embeddings=False, rope_factor=8.0, global_batch_size=512,
                    target="h100x64")
  c.train.grad_accum_steps = 4  # microbatch 2 per GPU
  c.model.remat_policy = "full"  # the saved matmul outputs of 80 layers do not fit
  return c
