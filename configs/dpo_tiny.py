"""CPU smoke test of DPO: the tiny model learns to prefer reversed words (a minute on 2 cores).

Full fine-tuning with a frozen copy of the initial params as the reference, on
examples/finetune/preference.jsonl (scripts/make_finetune_examples.py). Without
checkpoint.init_from the policy starts from a random init (a warning says so); give a trained
tiny run's workdir to start from real weights:

  python -m jaxtrain.main --config=configs/dpo_tiny.py --config.checkpoint.init_from=runs/tiny
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "tiny.py"))
  c.train.objective = "dpo"
  c.dpo.beta = 0.1
  c.data.source = "jsonl"
  c.data.format = "preference"
  c.data.train_paths = os.path.join(HERE, "..", "examples", "finetune", "preference.jsonl")
  c.data.eval_fraction = 0.05
  c.data.tokenizer = "byte"
  c.train.seq_len = 32  # prompt + response of one pair fit in 33 tokens
  c.train.global_batch_size = 16  # pairs per step
  c.train.steps = 60
  c.train.log_every = 10
  c.train.eval_every = 30
  c.train.eval_batches = 4
  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  return c
