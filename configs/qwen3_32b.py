"""Qwen3 32B (dense): 32.8B parameters, per-head q/k RMSNorm, 64 query / 8 kv heads of 128.

Target: two 8-GPU H100 hosts (h100x16). Float32 master weights, their gradients and Adam's two
moments take 16 bytes per parameter, 525 GB for 32.8B: more than one host's 640 GB leaves for
activations, so the state is sharded (fsdp) over 16 GPUs. Global batch 256 x 8192 tokens as 16
microbatches of one sequence per GPU, remat `save_qkv_proj`: `--dry_run` (XLA's GPU compiler)
needs 60.2 GiB of the H100's 79.1 GiB (`minimal` would also keep the MLP's gate and up outputs,
25 GiB each: 113 GiB; `full` 50.5 GiB). Sizes from the published config.json
(Qwen/Qwen3-32B): 64 layers, hidden 5120, MLP 25600, vocab 151936, RoPE base 1e6.
"""

from jaxtrain.config import accelerator_config


def get_config():
  c = accelerator_config(target="h100x16", global_batch_size=256)
  m = c.model
  m.family = "qwen3"
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = 151936, 64, 5120, 25600
  m.num_heads, m.num_kv_heads, m.head_dim = 64, 8, 128
  m.norm_eps, m.rope_theta, m.max_position_embeddings = 1e-6, 1e6, 40960
  m.tie_embeddings = False
  c.model.remat_policy = "save_qkv_proj"
  c.train.grad_accum_steps = 16  # microbatch 1 per GPU
  return c
