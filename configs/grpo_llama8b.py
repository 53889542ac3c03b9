"""Llama 3.1 8B, GRPO with LoRA adapters: online RL on math-style prompts with verifiable answers.

Prompt records are JSONL {"prompt": ..., "answer": ...}: the prompt chat messages (or a string)
asking for the final answer inside <answer>...</answer>, the answer column read by the reward
functions (exact_match on the answer, answer_format on the tags; summed, so a completion scores
0 to 2). Each step samples 8 completions of 16 prompts with the current adapters (128 rows of
prompt + completion, at most 1024 tokens) and updates once on them. The reference is the base
with adapters off (no second copy of the weights), the base frozen in bfloat16 from a converted
checkpoint.

  python -m jaxtrain.main --config=configs/grpo_llama8b.py --workdir=runs/grpo \\
    --config.checkpoint.init_from=weights/llama8b-instruct \\
    --config.data.tokenizer=hf:weights/llama8b-instruct/tokenizer.json \\
    --config.data.train_paths='math/*.jsonl'

Sized for llama8b.py's target, 8 H100s (fsdp=8): `--dry_run` compiles the train step for it
with XLA's GPU compiler, 18.5 GiB per GPU (2.0 params, 0.2 optimizer, 16.3 temporaries; the
policy's and the reference's passes over 32 rows of 1024 tokens per microbatch). The rollouts'
KV cache adds
128 rows × 1024 positions × 32 layers × 8 KV heads × 128 × 2 (k, v) × 2 bytes = 16 GiB over
the 8 GPUs (2 GiB each), alive only while generating.
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "llama8b.py"))
  c.model.param_dtype = "bfloat16"  # the frozen base; adapters and their optimizer stay float32
  c.model.remat_policy = "minimal"
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.lora.targets = "q,k,v,o,gate,up,down"

  c.train.objective = "grpo"
  c.data.source = "jsonl"
  c.data.format = "prompt"
  c.data.eval_fraction = 0.02
  c.grpo.num_generations = 8
  c.grpo.num_iterations = 1
  c.grpo.max_new_tokens = 512
  c.grpo.temperature = 1.0
  c.grpo.top_p = 1.0
  c.grpo.beta = 0.04
  c.grpo.epsilon = 0.2
  c.grpo.reward_fns = "jaxtrain.objectives.grpo.rewards:exact_match,jaxtrain.objectives.grpo.rewards:answer_format"
  c.train.seq_len = 1024  # prompts of up to 512 tokens and their completions
  c.train.global_batch_size = 16  # prompts per step (x 8 completions = 128 rows)
  c.train.grad_accum_steps = 4  # 32 rows per microbatch: 4 per GPU
  c.train.steps = 500
  c.train.eval_every = 50
  c.train.eval_batches = 2
  c.train.loss_chunk_size = 1024
  c.optim.learning_rate = 1e-5
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  c.checkpoint.every_steps = 50
  return c
