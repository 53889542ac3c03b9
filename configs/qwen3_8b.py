"""Qwen3 8B (dense): 8.19B parameters, per-head q/k RMSNorm, head dim 128, untied embeddings.

Target: one 8-GPU H100 host (h100x8), like llama8b.py; fsdp over its 8 GPUs. Global batch 256 x
8192 tokens as 16 microbatches of 2 sequences per GPU, remat `minimal`: `--dry_run` (XLA's GPU
compiler) needs 64.8 GiB of the H100's 79.1 GiB. Sizes from the published
config.json (Qwen/Qwen3-8B): 36 layers, hidden 4096, 32 query / 8 kv heads, MLP 12288, vocab
151936, RoPE base 1e6, RMSNorm eps 1e-6.

  python -m jaxtrain.interop.hf import --hf_dir=Qwen3-8B --out=weights/qwen3_8b
  python -m jaxtrain.main --config=configs/qwen3_8b.py \\
    --config.checkpoint.init_from=weights/qwen3_8b
"""

from jaxtrain.config import accelerator_config


def get_config():
  c = accelerator_config(target="h100x8", global_batch_size=256)
  m = c.model
  m.family = "qwen3"
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = 151936, 36, 4096, 12288
  m.num_heads, m.num_kv_heads, m.head_dim = 32, 8, 128
  m.norm_eps, m.rope_theta, m.max_position_embeddings = 1e-6, 1e6, 40960
  m.tie_embeddings = False
  c.train.grad_accum_steps = 16  # microbatch 2 per GPU
  return c
