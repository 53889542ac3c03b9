"""CPU smoke test of QLoRA: sft_lora_tiny.py over a base stored as 4-bit NormalFloat codes.

Every projection weight of the frozen base is kept as NF4 codes with one scale per 32 inputs
(the tiny model's 128-wide inputs hold 4 groups) and dequantized layer by layer in the forward
pass.
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "sft_lora_tiny.py"))
  c.lora.quantize_base = "nf4"
  c.lora.quant_group_size = 32
  return c
