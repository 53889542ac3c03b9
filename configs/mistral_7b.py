"""Mistral 7B v0.3: 7.25B parameters, Llama's decoder with a 32768 vocabulary, full attention.

Target: one 8-GPU H100 host (h100x8), like llama8b.py; fsdp over its 8 GPUs. Global batch 256 x
8192 tokens as 16 microbatches of 2 sequences per GPU, remat `minimal`: `--dry_run` (XLA's GPU
compiler) needs 62.2 GiB of the H100's 79.1 GiB. Sizes from the published
config.json (mistralai/Mistral-7B-v0.3): 32 layers, hidden 4096, 32 query / 8 kv heads, MLP
14336, RoPE base 1e6, `sliding_window: null` (v0.1 had 4096: set model.sliding_window=4096).
"""

from jaxtrain.config import accelerator_config


def get_config():
  c = accelerator_config(target="h100x8", global_batch_size=256)
  m = c.model
  m.family = "mistral"
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = 32768, 32, 4096, 14336
  m.num_heads, m.num_kv_heads, m.head_dim = 32, 8, 128
  m.norm_eps, m.rope_theta, m.max_position_embeddings = 1e-5, 1e6, 32768
  m.tie_embeddings = False
  c.train.grad_accum_steps = 16  # microbatch 2 per GPU
  return c
