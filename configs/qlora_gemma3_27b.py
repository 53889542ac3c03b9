"""Gemma 3 27B, QLoRA on one 24 GB GPU: LoRA adapters over a frozen NF4 base.

Every projection of the base is stored as 4-bit NormalFloat codes with one scale per 64 inputs
(0.56 bytes per weight: 14.6 GB for the 26B projection weights), dequantized to bfloat16 one
layer at a time; the tied 262208 x 5376 embedding stays bfloat16 (2.8 GB), and the loss
contracts it as stored (no transposed copy). Target: one L4 (l4x1, 24 GB): 32 sequences of 1024
tokens per step as 32 microbatches of one, remat `full`, the loss over 256-token chunks of the
262K-word vocabulary: `--dry_run` (XLA's GPU compiler) needs 20.15 GiB of the L4's 22.5 GiB
(2048-token sequences: 21.24 GiB, over the 90% the verdict leaves to the runtime).

  python -m jaxtrain.interop.hf import --hf_dir=gemma-3-27b-it --out=weights/gemma3_27b
  python -m jaxtrain.main --config=configs/qlora_gemma3_27b.py --workdir=runs/qlora_gemma3 \\
    --config.checkpoint.init_from=weights/gemma3_27b \\
    --config.data.tokenizer=hf:weights/gemma3_27b/tokenizer.json \\
    --config.data.train_paths='chat/*.jsonl'
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "gemma3_27b.py"))
  c.target = "l4x1"
  c.model.param_dtype = "bfloat16"
  c.model.remat_policy = "full"
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.lora.dropout = 0.05
  c.lora.targets = "q,k,v,o,gate,up,down"
  c.lora.quantize_base = "nf4"
  c.lora.quant_group_size = 64

  c.data.source = "jsonl"
  c.data.format = "chat"
  c.train.seq_len = 1024
  c.train.global_batch_size = 32
  c.train.grad_accum_steps = 32
  c.train.steps = 2000
  c.train.eval_every = 200
  c.train.loss_chunk_size = 256
  c.optim.learning_rate = 2e-4
  c.optim.warmup_steps = 50
  c.optim.weight_decay = 0.0
  c.checkpoint.every_steps = 200
  return c
