"""Llama 3.1 405B: 405.85 B parameters, vocab 128256, llama3 RoPE scaling (factor 8).

Architecture as published; batch and parallelism are a starting point for accelerators: check
the fit for your device count with the dry run before spending a cluster.
"""

from jaxtrain.config import default_config


def get_config():
  c = default_config()
  c.model.vocab_size = 128256
  c.model.num_layers = 126
  c.model.d_model = 16384
  c.model.num_heads = 128
  c.model.num_kv_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 53248
  c.model.tie_embeddings = False
  c.model.norm_eps = 1e-5
  c.model.rope_theta = 500000.0
  c.model.rope_scaling.type = "llama3"
  c.model.rope_scaling.factor = 8.0
  c.model.rope_scaling.low_freq_factor = 1.0
  c.model.rope_scaling.high_freq_factor = 4.0
  c.model.rope_scaling.original_max_position_embeddings = 8192
  c.model.max_position_embeddings = 131072
  c.model.scan_layers = True
  c.model.remat_policy = "minimal"
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"

  c.attention.impl = "auto"
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1

  c.train.global_batch_size = 1024
  c.train.seq_len = 8192
  c.train.steps = 10000
  c.train.loss_chunk_size = 1024
  c.optim.learning_rate = 3e-4
  c.optim.warmup_steps = 1000
  return c
