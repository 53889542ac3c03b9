"""Llama 3.1 8B, QLoRA: LoRA adapters over a frozen base stored in 4-bit NormalFloat (NF4).

As sft_lora_llama8b.py, but every projection weight of the base is kept as 4-bit codes with one
scale per 64 input elements (0.56 bytes per weight instead of 2), dequantized to bfloat16 one
layer at a time in the forward pass. The frozen 8B base takes 5.6 GiB instead of 15.0 GiB, so
the whole run fits one 24 GB L4 (target l4x1): `--dry_run` (XLA's GPU compiler) needs 8.7 GiB of
its 22.5 GiB (docs/finetuning.md).

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
  # One 24 GB GPU, the setup QLoRA exists for: the same 32-sequence batch as 32 microbatches of
  # one 4096-token sequence, each layer recomputed in the backward pass.
  c.target = "l4x1"
  c.train.grad_accum_steps = 32
  c.model.remat_policy = "full"
  return c
