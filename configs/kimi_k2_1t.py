"""Kimi K2: the DeepSeek-V3 architecture at 1.03T parameters, 33B active per token (8 of 384
routed experts per layer beside one shared expert).

Target: 128 8-GPU H100 hosts (h100x1024). Expert parallelism within each host (mesh.expert=8:
each GPU holds 48 of every MoE layer's 384 experts) and FSDP across the hosts (mesh.fsdp=128
over mesh.dcn_fsdp=128 host groups), as deepseek_v3_671b.py does: float32 weights and
gradients, `full` remat. MuonClip (Muon with QK-clip at 100) as Kimi K2 was trained; bfloat16
optimizer state (Muon's momentum; AdamW's moments for the embeddings, head, norms, routers).
Global batch 1024 x 4096 tokens, one sequence per GPU. `--dry_run` gives the figures
(docs/performance.md has the table).

Sizes from the published config.json (moonshotai/Kimi-K2-Instruct): DeepSeek-V3's with 384
experts in one group, 64 heads, only the first layer dense, weights x2.827, vocab 163840, RoPE
base 50000 with YaRN x32 over 4096 positions.
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "deepseek_v3_671b.py"))
  c.target = "h100x1024"
  c.train.global_batch_size = 1024
  m = c.model
  m.vocab_size, m.num_heads, m.num_kv_heads = 163840, 64, 64
  m.rope_theta, m.max_position_embeddings = 50000.0, 131072
  m.rope_scaling.factor, m.rope_scaling.beta_fast = 32.0, 1.0  # beta_slow 1.0 too: one ramp dim
  moe = c.moe
  moe.num_experts, moe.dense_layers = 384, "0"
  moe.n_group, moe.topk_group, moe.routed_scaling_factor = 1, 1, 2.827
  m.mtp_depth = 0  # no multi-token-prediction layer (num_nextn_predict_layers: 0)
  c.mesh.expert, c.mesh.fsdp, c.mesh.dcn_fsdp = 8, 128, 128
  # MuonClip, as Kimi K2 trained: Muon for the projection matrices (one momentum buffer: half of
  # AdamW's optimizer state per device) and QK-clip at 100 on the heads' largest logits.
  c.optim.name = "muon"
  c.optim.muon.qk_clip_threshold = 100.0
  return c
