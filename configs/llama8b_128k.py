"""Llama 3.1 8B trained at 131072 tokens per sequence: long-context training by context parallelism.

Target: eight 8-GPU H100 hosts (h100x64). Each sequence is split over the 8 GPUs of a host
(mesh.context=8, NVLink: 16384 tokens per GPU, load-balanced for causal attention) and the
weights are sharded over all 64 (fsdp=8 across hosts, times context=8 within). Global batch 8 x
131072 tokens (1M tokens per step): one sequence per host. Attention gathers the whole
sequence's keys and values per layer (all_gather: under GQA they are 4x smaller than the
queries; `--config.attention.context_parallel=ring` passes them around the host instead). Remat
`minimal`. By the exact compile for the target (our Pallas kernels per chunk pair): 50.8 GiB of
the H100's 79.1 GiB per device (weights and Adam state 1.4 GiB, the rest a 16K-token slice's
activations); with mesh.context=4 (32K tokens per device) 92.8 GiB, which does not fit; with
16, 29.2 GiB.

The memory it needs on its target, by the exact compile: python -m jaxtrain.main
--config=configs/llama8b_128k.py --dry_run
"""

from jaxtrain.config import llama3_config


def get_config():
  c = llama3_config(num_layers=32, d_model=4096, num_heads=32, head_dim=128, mlp_dim=14336,
                    tie_embeddings=False, rope_factor=8.0, global_batch_size=8,
                    target="h100x64")
  c.train.seq_len = 131072
  c.mesh.data, c.mesh.fsdp, c.mesh.context, c.mesh.tensor = 1, 8, 8, 1
  c.attention.context_parallel = "all_gather"
  c.model.remat_policy = "minimal"
  c.train.loss_chunk_size = 8192  # 1024 positions per device per chunk
  c.optim.warmup_steps = 100
  c.train.steps = 1000
  return c
