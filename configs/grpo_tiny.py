"""CPU demo of GRPO: the tiny model learns, from a reward alone, to reverse words.

Prompts are examples/grpo/reverse.jsonl ({"prompt": "reverse: difo\\n", "answer": "ofid"};
scripts/make_finetune_examples.py). From a random init, each step samples 8 completions of 16
prompts with the current weights and scores them with `jaxtrain.objectives.grpo.rewards:similarity`,
partial credit in [0, 1] (how much of the reversal a completion gets right), so even a random model
gets a signal. The reference is the random init, so the KL penalty is kept small. On 2 CPU cores the
700 steps take 5 1/2 minutes, compile included, and the mean reward of the sampled completions
rises from 0.10 (first five logged steps) to 0.41 (last five); docs/finetuning.md has the run.
No supervised warm-up is needed here; `grpo.warmup_steps` adds one.
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "tiny.py"))
  c.train.objective = "grpo"
  c.data.source = "jsonl"
  c.data.format = "prompt"
  c.data.train_paths = os.path.join(HERE, "..", "examples", "grpo", "reverse.jsonl")
  c.data.eval_fraction = 0.05
  c.data.tokenizer = "byte"
  c.grpo.num_generations = 8
  c.grpo.max_new_tokens = 12  # the longest reversal (9 letters) and EOS fit
  c.grpo.beta = 0.01
  c.grpo.temperature = 1.0
  c.grpo.reward_fns = "jaxtrain.objectives.grpo.rewards:similarity"
  c.grpo.sample_prompts = 4
  c.grpo.warmup_steps = 0
  c.train.seq_len = 32  # "reverse: " + 9 letters + newline + BOS fit in 20 prompt tokens
  c.train.global_batch_size = 16  # prompts per step (x 8 completions = 128 rows)
  c.train.loss_chunk_size = 32
  c.train.steps = 700
  c.train.log_every = 5
  c.train.eval_every = 100
  c.train.eval_batches = 2
  c.optim.learning_rate = 2e-3
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  return c
