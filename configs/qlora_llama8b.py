"""Llama 3.1 8B, QLoRA: LoRA adapters over a frozen base stored in 4-bit NormalFloat (NF4).

As sft_lora_llama8b.py, but every projection weight of the base is kept as 4-bit codes with one
scale per 64 input elements (about 0.53 bytes per weight instead of 2), dequantized to bfloat16
one layer at a time in the forward pass. The 8B base then needs about 5 GB instead of 15 GB;
`--dry_run` shows the per-device memory next to sft_lora_llama8b.py and full fine-tuning
(docs/finetuning.md).

  python -m jaxtrain.main --config=configs/qlora_llama8b.py --workdir=runs/qlora \\
    --config.checkpoint.init_from=weights/llama8b \\
    --config.data.tokenizer=hf:weights/llama8b/tokenizer.json \\
    --config.data.train_paths='chat/*.jsonl'
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "sft_lora_llama8b.py"))
  c.lora.quantize_base = "nf4"
  c.lora.quant_group_size = 64
  return c
