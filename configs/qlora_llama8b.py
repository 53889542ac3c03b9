"""Llama 3.1 8B, QLoRA: LoRA adapters over a frozen base stored in 4-bit NormalFloat (NF4).

As sft_lora_llama8b.py, but every projection weight of the base is kept as 4-bit codes with one
scale per 64 input elements (0.56 bytes per weight instead of 2), dequantized to bfloat16 one
layer at a time in the forward pass. The frozen 8B base takes 5.6 GiB instead of 15.0 GiB;
`--dry_run --dry_run_devices=8` shows 32.0 GiB per device, against 36.0 for
sft_lora_llama8b.py and 52.0 for full fine-tuning with the same batch (docs/finetuning.md).

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
