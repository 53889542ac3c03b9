"""DeepSeek-V3: 671B parameters of which 37B active per token (8 of 256 routed experts per layer
beside one shared expert), multi-head latent attention.

Target: sixty-four 8-GPU H100 hosts (h100x512). Expert parallelism within each host
(mesh.expert=8: each GPU holds 32 of every MoE layer's 256 experts; tokens reach them by
all-to-all over NVLink) and FSDP across the hosts (mesh.fsdp=64 over mesh.dcn_fsdp=64 host
groups: weight gathers and one gradient reduction per step cross the data-center network,
all-to-alls never do). Float32 weights and gradients with bfloat16 Adam moments (12 bytes per
parameter) and `full` remat: what makes it fit (65.3 GiB per GPU). On 256 GPUs (fsdp=32),
even without the prediction module, it needs 72.2 GiB of the 71.2 GiB a fit leaves. Global
batch 512 x 4096 tokens, one sequence per GPU. `--dry_run` gives the figures
(docs/performance.md has the table).

Trained as the paper does: no Switch aux loss; the routers' correction biases move by 0.001
per step against their experts' load (moe.bias_update_rate); the sequence-wise balance loss at
1e-4; one multi-token-prediction module (11.6B more parameters: a [2D, D] projection and an MoE
block; embedding and head shared) whose loss is weighted 0.3.

Sizes from the published config.json (deepseek-ai/DeepSeek-V3): 61 layers (the first 3 dense,
intermediate 18432), hidden 7168, 128 heads with query/key dims 128 + 64 (RoPE) and value dims
128, a 512-wide key/value latent and a 1536-wide query bottleneck, experts of 2048 in 8 groups
(the best 4 eligible), weights x2.5, vocab 129280, YaRN x40 over 4096 positions.
"""

from jaxtrain.config import accelerator_config


def get_config():
  c = accelerator_config(target="h100x512", global_batch_size=512)
  m = c.model
  m.family = "deepseek_v3"
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = 129280, 61, 7168, 18432
  m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim = 128, 128, 192, 128
  m.qk_rope_head_dim, m.kv_lora_rank, m.q_lora_rank = 64, 512, 1536
  m.norm_eps, m.rope_theta, m.max_position_embeddings = 1e-6, 10000.0, 163840
  m.tie_embeddings = False
  y = m.rope_scaling
  y.type, y.factor, y.original_max_position_embeddings = "yarn", 40.0, 4096
  y.beta_fast, y.beta_slow, y.mscale, y.mscale_all_dim = 32.0, 1.0, 1.0, 1.0
  moe = c.moe
  moe.num_experts, moe.experts_per_token, moe.expert_mlp_dim = 256, 8, 2048
  moe.dense_layers = "0,1,2"
  moe.router_score, moe.router_bias = "sigmoid", True
  moe.n_group, moe.topk_group, moe.routed_scaling_factor = 8, 4, 2.5
  moe.num_shared_experts = 1
  moe.aux_loss_coef, moe.router_z_loss_coef = 0.0, 0.0
  moe.seq_aux_loss_coef, moe.bias_update_rate = 1e-4, 1e-3
  m.mtp_depth, m.mtp_loss_weight = 1, 0.3  # one prediction module, the paper's first weight
  m.remat_policy = "full"
  c.optim.state_dtype = "bfloat16"
  c.train.seq_len = 4096
  c.mesh.expert, c.mesh.fsdp, c.mesh.dcn_fsdp = 8, 64, 64
  return c
