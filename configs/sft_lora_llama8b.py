"""Llama 3.1 8B, supervised fine-tuning with LoRA adapters on every projection.

The base weights are frozen in bfloat16 (no float32 master copy: they never update) and read
from a converted Hugging Face checkpoint; only the adapters (rank 16: 42M params) train and
are checkpointed. Chat records ({"messages": [...]}) go through the tokenizer's chat template,
with the loss on the assistant turns.

  python -m jaxtrain.interop.hf import --hf_dir=Llama-3.1-8B-Instruct --out=weights/llama8b
  python -m jaxtrain.main --config=configs/sft_lora_llama8b.py --workdir=runs/sft_lora \\
    --config.checkpoint.init_from=weights/llama8b \\
    --config.data.tokenizer=hf:weights/llama8b/tokenizer.json \\
    --config.data.train_paths='chat/*.jsonl'
  python -m jaxtrain.interop.hf export --checkpoint=runs/sft_lora \\
    --config=configs/sft_lora_llama8b.py --out=exported/   # adapters merged into the weights
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
  c.lora.dropout = 0.05
  c.lora.targets = "q,k,v,o,gate,up,down"

  c.data.source = "jsonl"
  c.data.format = "chat"
  c.data.eval_fraction = 0.02
  c.train.seq_len = 4096
  # One 4096-token sequence per GPU per microbatch on the 8 H100s of llama8b.py's target:
  # `--dry_run` (XLA's GPU compiler) needs 16.1 GiB per GPU (docs/finetuning.md).
  c.train.global_batch_size = 32
  c.train.grad_accum_steps = 4
  c.train.steps = 2000
  c.train.eval_every = 200
  c.train.loss_chunk_size = 1024
  c.optim.learning_rate = 2e-4  # adapters tolerate (and need) a larger rate than full weights
  c.optim.warmup_steps = 50
  c.optim.weight_decay = 0.0
  c.checkpoint.every_steps = 200
  return c
