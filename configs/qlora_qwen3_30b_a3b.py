"""Qwen3-30B-A3B, QLoRA on one 24 GB GPU: LoRA adapters over a frozen NF4 base, experts included.

Every projection of the base, each of the 48 x 128 experts' gate/up/down among them, is stored
as 4-bit NormalFloat codes with one scale per 256 inputs (0.52 bytes per weight: 15.5 GiB for
the 29.8B projection weights), dequantized to bfloat16 one layer at a time; the routers, norms,
embedding and head stay bfloat16. Adapters of rank 16 on the attention projections (51 MiB).
Adapters on the experts work too (lora.targets=q,k,v,o,gate,up,down: per-expert A and B,
applied by the experts' grouped matmul), but at rank 16 they are 0.84B parameters over 6144
experts, 9.4 GiB with their Adam moments: more than this GPU has left. Target: one L4 (l4x1,
24 GB): 32 sequences of 1024 tokens per step as 32 microbatches of one, remat `full`:
`--dry_run` (XLA's GPU compiler) needs 17.95 GiB of the L4's 22.5 GiB.

  python -m jaxtrain.interop.hf import --hf_dir=Qwen3-30B-A3B --out=weights/qwen3_30b_a3b
  python -m jaxtrain.main --config=configs/qlora_qwen3_30b_a3b.py --workdir=runs/qlora_moe \\
    --config.checkpoint.init_from=weights/qwen3_30b_a3b \\
    --config.data.tokenizer=hf:weights/qwen3_30b_a3b/tokenizer.json \\
    --config.data.train_paths='chat/*.jsonl'
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "qwen3_30b_a3b.py"))
  # Adapters, data, optimizer and the one-GPU batch as sft_lora_qwen3_8b.py has them.
  sft = load_config_file(os.path.join(HERE, "sft_lora_qwen3_8b.py"))
  for group in ("lora", "data", "optim", "checkpoint", "train"):
    c[group] = sft[group]
  c.target = "l4x1"
  c.mesh.expert, c.mesh.fsdp = 1, -1
  c.model.param_dtype = "bfloat16"
  c.model.remat_policy = "full"
  c.lora.targets = "q,k,v,o"
  c.lora.quantize_base = "nf4"
  c.lora.quant_group_size = 256
  c.train.seq_len = 1024
  c.train.loss_chunk_size = 256
  return c
