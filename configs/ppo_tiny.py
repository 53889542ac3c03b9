"""CPU demo of PPO: the tiny model learns, from a reward alone, to reverse words, with a value
head as its critic.

The task and reward are grpo_tiny.py's (examples/grpo/reverse.jsonl,
`jaxtrain.objectives.grpo.rewards: similarity`, partial credit in [0, 1]). Each batch of rollouts
samples one completion of each of 64 x 2 prompts with the current weights; GAE advantages from the
value head (γ 1, λ 0.95), no KL penalty (the reference would be the random init: nothing worth
staying near); 4 epochs of 2 minibatches of 64 rows per batch of rollouts, 800 steps. On 2 CPU cores
(the development VM) the run takes about 2 1/2 minutes, compile included, and the mean reward of the
sampled completions rises from 0.02 (first five logged steps) to 0.30 (last five), the greedy
held-out reward to 0.31 at step 800; the model learns to stop (completions of 6 tokens on
average, from 12). docs/finetuning.md has the run.
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "tiny.py"))
  c.train.objective = "ppo"
  c.model.value_head = True  # the critic
  c.data.source = "jsonl"
  c.data.format = "prompt"
  c.data.train_paths = os.path.join(HERE, "..", "examples", "grpo", "reverse.jsonl")
  c.data.eval_fraction = 0.05
  c.data.tokenizer = "byte"
  c.grpo.max_new_tokens = 12  # the longest reversal (9 letters) and EOS fit
  c.grpo.temperature = 1.0
  c.grpo.reward_fns = "jaxtrain.objectives.grpo.rewards:similarity"
  c.grpo.sample_prompts = 4
  c.ppo.epochs = 4
  c.ppo.minibatches = 2
  c.ppo.kl_coef = 0.0
  c.ppo.vf_coef = 0.1
  c.train.seq_len = 32
  c.train.global_batch_size = 64  # rows per optimizer step; 128 prompts per batch of rollouts
  c.train.loss_chunk_size = 32
  c.train.steps = 800
  c.train.log_every = 4
  c.train.eval_every = 200
  c.train.eval_batches = 2
  c.optim.learning_rate = 2e-3
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  return c
