"""CPU smoke test of LoRA: sft_tiny.py with rank-8 adapters on every projection.

Only the adapters (and their Adam moments) train and are checkpointed; the base is frozen. Give a
trained tiny run as the base (--config.checkpoint.init_from=runs/tiny); without one the base is
the seed's random init (a warning says so), which is enough to see the adapters learn.
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "sft_tiny.py"))
  c.lora.rank = 8
  c.lora.alpha = 16.0
  c.lora.dropout = 0.0
  c.lora.targets = "q,k,v,o,gate,up,down"
  c.optim.learning_rate = 1e-2  # adapters start at zero effect and need a larger step
  c.optim.weight_decay = 0.0
  return c
