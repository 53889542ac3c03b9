"""Mixtral 8x7B: 46.7B parameters of which 12.9B active per token (2 of 8 experts per layer).

Target: one 8-GPU H100 host (h100x8), with expert parallelism: each GPU holds one expert of
every layer (mesh.expert=8), and the rest of the weights are sharded 8 ways as by FSDP. Float32
weights and gradients with Adam's moments would take 16 bytes per parameter, 747 GB, more than
the host's 640 GB; so this config trains in bfloat16 throughout: bfloat16 weights (no float32
master copy) and bfloat16 Adam moments, 6 bytes per parameter plus the bfloat16 gradients
(10.9 + 21.7 GiB per GPU). Global batch 8 x 4096 tokens, one sequence per GPU and no
accumulation (float32 accumulators would add 2 x 21.7 GiB), `full` remat: `--dry_run` (XLA's
GPU compiler) needs 60.9 GiB of the H100's 79.1 GiB. For float32 master weights, use two hosts
(--config.target=h100x16 --config.mesh.fsdp=2 --config.model.param_dtype=float32).
Sizes from the published config.json
(mistralai/Mixtral-8x7B-v0.1): 32 layers, hidden 4096, 32 query / 8 kv heads, experts of
14336, vocab 32000, RoPE base 1e6.
"""

from jaxtrain.config import accelerator_config


def get_config():
  c = accelerator_config(target="h100x8", global_batch_size=8)
  m = c.model
  m.family = "mixtral"
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = 32000, 32, 4096, 14336
  m.num_heads, m.num_kv_heads, m.head_dim = 32, 8, 128
  m.norm_eps, m.rope_theta, m.max_position_embeddings = 1e-5, 1e6, 32768
  m.tie_embeddings = False
  m.remat_policy = "full"
  m.param_dtype = "bfloat16"
  c.moe.num_experts, c.moe.experts_per_token, c.moe.expert_mlp_dim = 8, 2, 14336
  c.moe.aux_loss_coef = 0.02  # what Mixtral's own config trains with (router_aux_loss_coef)
  c.mesh.expert, c.mesh.fsdp = 8, 1
  c.optim.state_dtype = "bfloat16"
  c.train.seq_len = 4096
  return c
