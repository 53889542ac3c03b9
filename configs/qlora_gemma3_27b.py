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
  # Adapters, data, optimizer and the one-GPU batch as sft_lora_qwen3_8b.py has them.
  sft = load_config_file(os.path.join(HERE, "sft_lora_qwen3_8b.py"))
  for group in ("lora", "data", "optim", "checkpoint", "train"):
    c[group] = sft[group]
  c.target = "l4x1"
  c.model.param_dtype = "bfloat16"
  c.model.remat_policy = "full"
  c.lora.quantize_base = "nf4"
  c.lora.quant_group_size = 64
  c.train.seq_len = 1024
  c.train.loss_chunk_size = 256
  return c
