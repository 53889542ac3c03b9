"""Gemma 3 27B (the text decoder): 27.0B parameters, 62 layers in the pattern five sliding-window
(1024 tokens, RoPE base 1e4) then one global (RoPE base 1e6, linear scaling x8), (1 + w) sandwich
norms, q/k norms, GeGLU, embeddings times sqrt(5376), tied head, softmax scale 168 ** -0.5.

Target: two 8-GPU H100 hosts (h100x16): its 16 bytes per parameter of float32 training state
(432 GB) want the second host's memory, as Qwen3 32B's do. Global batch 256 x 8192 tokens as 16
microbatches of one sequence per GPU, remat `save_qkv_proj`: `--dry_run` (XLA's GPU compiler)
needs 58.3 GiB of the H100's 79.1 GiB (`minimal`: 109 GiB; `full`: 53.2 GiB). Sizes from the published config.json
(google/gemma-3-27b-pt, its text_config): hidden 5376, 32 query / 16 kv heads of 128, MLP 21504,
vocab 262208.
"""

from jaxtrain.config import accelerator_config

NUM_LAYERS = 62


def gemma3_layer_types(num_layers: int, period: int = 6) -> str:
  """Gemma 3's pattern: every `period`-th layer global ("full"), the others "sliding"."""
  return ",".join("full" if (i + 1) % period == 0 else "sliding" for i in range(num_layers))


def get_config():
  c = accelerator_config(target="h100x16", global_batch_size=256)
  m = c.model
  m.family = "gemma3"
  m.vocab_size, m.num_layers, m.d_model, m.mlp_dim = 262208, NUM_LAYERS, 5376, 21504
  m.num_heads, m.num_kv_heads, m.head_dim = 32, 16, 128
  m.norm_eps, m.max_position_embeddings = 1e-6, 131072
  m.rope_theta = 1e6
  m.rope_scaling.type, m.rope_scaling.factor = "linear", 8.0
  m.local_rope_theta = 1e4
  m.sliding_window = 1024
  m.layer_types = gemma3_layer_types(NUM_LAYERS)
  m.query_pre_attn_scalar = 168.0
  m.tie_embeddings = True
  c.model.remat_policy = "save_qkv_proj"
  c.train.grad_accum_steps = 16  # microbatch 1 per GPU
  return c
