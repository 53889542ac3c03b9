"""CPU demo: a ~3.5M-parameter Llama trained on the Python standard library's source as bytes.

No download: the corpus is found at run time with sysconfig. Finishes in under 3 minutes on a
2-core CPU; eval loss ends far below the corpus' byte-unigram entropy (3.24 nats/byte).
"""

from jaxtrain.config import default_config


def get_config():
  c = default_config()
  c.model.vocab_size = 384  # 256 bytes + EOS, padded so tensor-parallel sizes divide it
  c.model.num_layers = 4
  c.model.d_model = 256
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 64
  c.model.mlp_dim = 768
  c.model.rope_theta = 10000.0
  c.model.max_position_embeddings = 1024
  c.model.remat_policy = "none"  # memory is plentiful; skip the recompute on CPU

  c.train.steps = 600
  c.train.global_batch_size = 16
  c.train.seq_len = 256
  c.train.log_every = 25
  c.train.eval_every = 200
  c.train.eval_batches = 8
  c.train.loss_chunk_size = 256

  c.optim.learning_rate = 2e-3
  c.optim.warmup_steps = 50
  c.optim.weight_decay = 0.1

  c.data.source = "stdlib_bytes"
  return c
