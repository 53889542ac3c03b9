"""CPU smoke test of supervised fine-tuning: the tiny model learns to reverse words.

Prompt/completion records (examples/finetune/sft.jsonl, from scripts/make_finetune_examples.py)
packed into rows; the loss counts completion tokens only. Full fine-tuning; the LoRA and QLoRA
variants are sft_lora_tiny.py and qlora_tiny.py. Start from a trained tiny run with
--config.checkpoint.init_from=runs/tiny (default: a random init).
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "tiny.py"))
  c.data.source = "jsonl"
  c.data.format = "prompt_completion"
  c.data.train_paths = os.path.join(HERE, "..", "examples", "finetune", "sft.jsonl")
  c.data.eval_fraction = 0.05
  c.data.tokenizer = "byte"
  c.train.seq_len = 128  # about five records per packed row
  c.train.global_batch_size = 16
  c.train.steps = 80
  c.train.log_every = 10
  c.train.eval_every = 40
  c.train.eval_batches = 4
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 10
  return c
