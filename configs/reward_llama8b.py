"""Llama 3.1 8B as a reward model: a score head trained on preference pairs with full fine-tuning.

The model starts from a converted (usually SFT'd) Llama checkpoint: everything but its vocabulary
head is read, and the score head [4096, 1] starts at zero. Preference records are JSONL
{"prompt", "chosen", "rejected"}, the prompt a string or chat messages; a pair's reward is the
score at each response's last token, trained with the Bradley-Terry loss at a small learning
rate.

  python -m jaxtrain.main --config=configs/reward_llama8b.py --workdir=runs/reward \\
    --config.checkpoint.init_from=runs/sft \\
    --config.data.tokenizer=hf:weights/llama8b/tokenizer.json \\
    --config.data.train_paths='prefs/*.jsonl'
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "llama8b.py"))
  c.train.objective = "reward"
  c.data.source = "jsonl"
  c.data.format = "preference"
  c.data.eval_fraction = 0.02
  # Prompt + response per side: rows of seq_len + 1 = 2048 tokens (cuDNN attention needs an even
  # length).
  c.train.seq_len = 2047
  c.train.global_batch_size = 64  # preference pairs per step
  c.train.grad_accum_steps = 4  # 2 pairs (4 rows of 2048 tokens) per GPU per microbatch
  c.train.steps = 1000
  c.train.eval_every = 100
  c.optim.learning_rate = 2e-6
  c.optim.warmup_steps = 30
  c.optim.weight_decay = 0.0
  c.optim.min_lr_ratio = 0.0
  c.checkpoint.every_steps = 100
  return c
