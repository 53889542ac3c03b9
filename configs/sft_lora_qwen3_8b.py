"""Qwen3 8B, supervised fine-tuning with LoRA adapters on every projection, on one 24 GB GPU.

The frozen base is bfloat16 (16.4 GB; it never updates, so no float32 copy) and comes from a
converted Hugging Face checkpoint; only the rank-16 adapters and their optimizer state train
and are checkpointed. Target: one L4 (l4x1, 24 GB), where a single-GPU fine-tune runs: the batch
of 32 sequences of 2048 tokens goes as 32 microbatches of one, each layer recomputed in the
backward pass (remat `full`): `--dry_run` (XLA's GPU compiler) needs 17.2 GiB of its 22.5 GiB.
Chat records go through the tokenizer's chat template, the loss
on the assistant turns.

  python -m jaxtrain.interop.hf import --hf_dir=Qwen3-8B --out=weights/qwen3_8b
  python -m jaxtrain.main --config=configs/sft_lora_qwen3_8b.py --workdir=runs/sft_qwen3 \\
    --config.checkpoint.init_from=weights/qwen3_8b \\
    --config.data.tokenizer=hf:weights/qwen3_8b/tokenizer.json \\
    --config.data.train_paths='chat/*.jsonl'
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "qwen3_8b.py"))
  # The adapters, chat data, optimizer and checkpoint cadence of the Llama 8B LoRA config.
  sft = load_config_file(os.path.join(HERE, "sft_lora_llama8b.py"))
  for group in ("lora", "data", "optim", "checkpoint"):
    c[group] = sft[group]
  c.train.steps, c.train.eval_every = sft.train.steps, sft.train.eval_every
  c.target = "l4x1"
  c.model.param_dtype = "bfloat16"  # the frozen base; adapters and their optimizer stay float32
  c.model.remat_policy = "full"
  c.train.seq_len = 2048
  c.train.global_batch_size = 32
  c.train.grad_accum_steps = 32
  c.train.loss_chunk_size = 512  # [1, 512, 151936] float32 logits at a time
  return c
