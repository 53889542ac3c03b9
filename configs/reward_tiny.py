"""CPU smoke test of reward-model training: the tiny model learns to score the correct reversal
of a word above a wrong answer (a few minutes on 2 cores).

A score head on the tiny model (train.objective='reward' implies model.score_head), trained with
the Bradley-Terry loss on examples/finetune/preference.jsonl (scripts/make_finetune_examples.py:
the chosen answer reverses the word, the rejected one is the word itself or its reversal in
capitals), 5% of the pairs held out. From a random init it reaches a held-out accuracy
(`eval_accuracy`, 128 held-out pairs) of 0.75 or more at step 300, chance being 0.5 (0.82 on one
CPU device, 0.80 on 8 emulated ones). Start from a trained tiny run with
--config.checkpoint.init_from=runs/tiny to begin from a language model (its vocabulary head is
left out, the score head starts at zero).

  python -m jaxtrain.main --config=configs/reward_tiny.py --workdir=runs/reward_tiny

Its checkpoint at step 300 is a reward source for GRPO or PPO on the same prompts
(examples/grpo/reverse.jsonl):

  python -m jaxtrain.main --config=configs/grpo_tiny.py --workdir=runs/grpo_rm \
      --config.grpo.reward_models=runs/reward_tiny
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "tiny.py"))
  c.train.objective = "reward"
  c.data.source = "jsonl"
  c.data.format = "preference"
  c.data.train_paths = os.path.join(HERE, "..", "examples", "finetune", "preference.jsonl")
  c.data.eval_fraction = 0.05
  c.data.tokenizer = "byte"
  c.train.seq_len = 32  # prompt + response of one pair fit in 33 tokens
  c.train.global_batch_size = 16  # pairs per step
  c.train.steps = 300
  c.train.log_every = 20
  c.train.eval_every = 50
  c.train.eval_batches = 8
  c.checkpoint.every_steps = 300  # the trained model, for grpo.reward_models
  c.optim.learning_rate = 5e-4
  c.optim.warmup_steps = 20
  c.optim.weight_decay = 0.0
  return c
