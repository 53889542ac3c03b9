"""Qwen3-235B-A22B: 235B parameters of which 22B active per token (8 of 128 experts per layer).

Target: sixteen 8-GPU H100 hosts (h100x128). Expert parallelism within each host
(mesh.expert=8: each GPU holds 16 of every layer's 128 experts, and tokens reach them by
all-to-all over NVLink) and FSDP across the hosts (mesh.fsdp=16 over mesh.dcn_fsdp=16 host
groups: the weights' gathers and one gradient reduction per step cross the data-center
network, all-to-alls never do). Float32 weights and gradients with bfloat16 Adam moments: 12
bytes per parameter, 13.7 GiB per GPU. Global batch 128 x 4096 tokens, one sequence per GPU
(no accumulation: float32 accumulators would add 13.7 GiB), `full` remat: `--dry_run` (XLA's
GPU compiler) needs 57.1 GiB of the H100's 79.1 GiB. The dropless dispatch sizes each GPU's
exchange buffers for the worst case (all of a GPU's 32768 token-expert assignments bound for
one peer): 8 x 32768 rows, which is what longer sequences grow first.

On TPU: a v5p-128 slice (64 chips) fits with --config.target=v5p-128 --config.mesh.expert=4
--config.mesh.fsdp=16 --config.mesh.dcn_fsdp=1 --config.train.global_batch_size=64: 56.9 GiB of
95.7 GiB by libtpu's compiler (a 4x4x4 torus: the expert axis must be a product of its sides).
Sizes from the published config.json (Qwen/Qwen3-235B-A22B): 94 layers, hidden 4096, 64 query /
4 kv heads of 128, experts of 1536.
"""

from jaxtrain.config import qwen3_moe_config


def get_config():
  c = qwen3_moe_config(num_layers=94, d_model=4096, num_heads=64, expert_mlp_dim=1536,
                       mlp_dim=12288, target="h100x128", global_batch_size=128)
  c.model.remat_policy = "full"
  c.mesh.expert, c.mesh.fsdp, c.mesh.dcn_fsdp = 8, 16, 16
  c.optim.state_dtype = "bfloat16"
  c.train.seq_len = 4096
  return c
