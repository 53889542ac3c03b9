"""Qwen3-30B-A3B: 30.5B parameters of which 3.3B active per token (8 of 128 experts per layer).

Target: one 8-GPU H100 host (h100x8), with expert parallelism: each GPU holds 16 of every
layer's 128 experts (mesh.expert=8), and the rest of the weights are sharded 8 ways as by FSDP.
Float32 weights and gradients with bfloat16 Adam moments: 12 bytes per parameter, 14.2 GiB per
GPU each for the weights and the moments. Global batch 64 x 4096 tokens as 8 microbatches of 1
sequence per GPU, `full` remat: `--dry_run` (XLA's GPU compiler) needs 64.7 GiB of the H100's
79.1 GiB (8192-token sequences need about 70 GiB, at the edge of the 10% left to the runtime; the
dropless dispatch's buffers grow with the tokens per GPU).
Sizes from the published config.json (Qwen/Qwen3-30B-A3B):
48 layers, hidden 2048, 32 query / 4 kv heads of 128, experts of 768, vocab 151936, RoPE base
1e6, norm_topk_prob true.
"""

from jaxtrain.config import qwen3_moe_config


def get_config():
  c = qwen3_moe_config(num_layers=48, d_model=2048, num_heads=32, expert_mlp_dim=768,
                       mlp_dim=6144, target="h100x8", global_batch_size=64)
  c.model.remat_policy = "full"
  c.mesh.expert, c.mesh.fsdp = 8, 1
  c.optim.state_dtype = "bfloat16"
  c.train.seq_len = 4096
  c.train.grad_accum_steps = 8  # microbatch 1 per GPU
  return c
