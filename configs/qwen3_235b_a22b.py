"""Qwen3-235B-A22B: 235B parameters of which 22B active per token (8 of 128 experts per layer).

Target: eight 8-GPU H100 hosts (h100x64). Expert parallelism within each host (mesh.expert=8:
each GPU holds 16 of every layer's 128 experts, tokens cross NVLink by all-to-all) and FSDP
across the hosts (mesh.fsdp=8 over mesh.dcn_fsdp=8 host groups: one gradient reduction per
step crosses the data-center network). Float32 weights and gradients with bfloat16 Adam
moments: 12 bytes per parameter, 41 GiB per GPU. Global batch 256 x 8192 tokens as 4
microbatches of 1 sequence per GPU, `full` remat. `--dry_run` has the memory figure. Sizes
from the published config.json (Qwen/Qwen3-235B-A22B): 94 layers, hidden 4096, 64 query / 4 kv
heads of 128, experts of 1536.
"""

from jaxtrain.config import qwen3_moe_config


def get_config():
  c = qwen3_moe_config(num_layers=94, d_model=4096, num_heads=64, expert_mlp_dim=1536,
                       mlp_dim=12288, target="h100x64", global_batch_size=256)
  c.model.remat_policy = "full"
  c.mesh.expert, c.mesh.fsdp, c.mesh.dcn_fsdp = 8, 8, 8
  c.optim.state_dtype = "bfloat16"
  c.train.grad_accum_steps = 4  # microbatch 1 per GPU
  return c
