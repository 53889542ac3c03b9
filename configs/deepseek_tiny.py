"""CPU demo of the DeepSeek-V3 architecture: tiny.py's budget with latent attention and DeepSeek's
Mixture of Experts.

Latent attention (4 heads: query/key dims 32 of which 8 carry RoPE, value dims 32; a 32-wide
key/value latent, a 48-wide query bottleneck); the first layer dense, the other three MoE layers
of 8 experts of width 96 in 4 groups (the best 2 groups eligible per token), 2 chosen per token
by sigmoid scores plus the correction bias, weights renormalized and scaled by 2.5, beside one
shared expert, and one multi-token-prediction module (its loss at weight 0.3, reported as
mtp_loss). Balancing as the paper does it: no Switch aux loss, the correction biases moved
after every step, the sequence-wise balance loss at a small weight. The paper's bias step of
0.001 is for trillions of tokens; over this 200-step run it moves a bias by 0.2 at most (the
busiest expert still took 3.81x the mean load at step 200, measured without the prediction
module), so the demo steps 0.01: the busiest expert's load over the mean goes from 3.17x at
step 20 to 1.29x at step 200 (eval 1.25x; with no balancing 3.92x), eval loss 2.2140 against
2.2766 unbalanced, and the prediction module's eval loss (two tokens ahead) 2.0460. No download;
trains on the Python standard library's bytes like tiny.py (under 3 minutes on 2 cores).

Expert parallelism on emulated devices (the experts split 4 ways, the batch 2 ways):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jaxtrain.main \\
      --config=configs/deepseek_tiny.py --workdir=runs/deepseek_tiny \\
      --config.mesh.expert=4 --config.mesh.fsdp=2
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "tiny.py"))
  c.model.family = "deepseek_v3"
  c.model.num_heads = 4
  c.model.num_kv_heads = 4  # latent attention: every head has its own keys and values
  c.model.head_dim = 32  # query/key: 24 without RoPE + 8 with
  c.model.qk_rope_head_dim = 8
  c.model.v_head_dim = 32
  c.model.kv_lora_rank = 32
  c.model.q_lora_rank = 48
  c.model.mlp_dim = 384  # the dense first layer
  c.moe.num_experts = 8
  c.moe.experts_per_token = 2
  c.moe.expert_mlp_dim = 96
  c.moe.dense_layers = "0"
  c.moe.router_score = "sigmoid"
  c.moe.router_bias = True
  c.moe.n_group = 4
  c.moe.topk_group = 2
  c.moe.routed_scaling_factor = 2.5
  c.moe.num_shared_experts = 1
  c.moe.aux_loss_coef = 0.0
  c.moe.router_z_loss_coef = 0.0
  c.moe.seq_aux_loss_coef = 1e-4
  c.moe.bias_update_rate = 1e-2
  c.model.mtp_depth = 1  # one multi-token-prediction module, as DeepSeek-V3 trains
  return c
