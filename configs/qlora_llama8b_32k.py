"""Llama 3.1 / 3.3 8B, QLoRA at 32,768-token sequences on one 24 GB RTX 4090 (rtx4090x1).

qlora_llama8b.py (rank-16 adapters on all seven projections over an NF4 base, one scale per 64
inputs) at 8x its sequence length: 4 sequences of 32768 tokens per step (the same 131,072
tokens), as 4 microbatches of one sequence, each layer recomputed in the backward pass (remat
`full`). What it takes to fit one 24 GB card at this length:

- attention by our Triton flash kernels (attention.impl=pallas) in 64 x 64 blocks: cuDNN's fused
  attention takes packed documents as a dense [T, T] mask (2 GiB at 32K), and the kernels'
  default 128 x 64 blocks ask 115,712 bytes of shared memory, more than the 4090's 101,376;
- no adapter dropout: its keep-masks and the dropped copies of 32K-token inputs cost 1.3 GiB;
- the adapters' Adam moments in pinned host memory between steps (optim.offload_state: 0.31 GiB
  off the card).

`--dry_run` (XLA's GPU compiler, no device; jax 0.10.2, the CI's check_configs): 20.91 GiB of
the card's 23.65 GiB (headroom +0.37 GiB under the 90% the verdict leaves to the runtime; jax
0.12's compiler: 18.71 GiB, +2.57): the NF4 base and the adapters 5.77 GiB, temporaries 15.14
GiB, 8.00 GiB of them the 32 layers' saved 32K x 4096 inputs; host (pinned) 0.31 GiB. One
device, so no collectives; the step's 6.30e15 FLOPs of matmuls take 38 s at the card's 165
TFLOP/s bf16 peak (an estimate, not a measurement). A card that also drives a display gives the
desktop part of that headroom; --config.lora.quant_group_size=256 takes 0.3 GiB off the base
(20.61 GiB). With 8192-token sequences the saved inputs shrink 4x.

Loading: the trainer restores the bfloat16 base onto the card and quantizes it there
(jaxtrain/train/loop.py, _restore_or_init): 15.0 GiB of bfloat16 beside the 5.6 GiB of NF4 for
a moment before the first step, under the card's 23.65 GiB (arithmetic, not compiled).

  python -m jaxtrain.main --config=configs/qlora_llama8b_32k.py --workdir=runs/qlora_32k \\
    --config.checkpoint.init_from=weights/llama8b \\
    --config.data.tokenizer=hf:weights/llama8b/tokenizer.json \\
    --config.data.train_paths='long_chat/*.jsonl'
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "qlora_llama8b.py"))
  c.target = "rtx4090x1"
  c.train.seq_len = 32768  # within Llama 3.1's 131072 positions (RoPE scaled x8)
  c.train.global_batch_size = 4
  c.train.grad_accum_steps = 4  # microbatches of one sequence
  c.model.remat_policy = "full"
  c.attention.impl = "pallas"
  c.attention.block_q, c.attention.block_k = 64, 64
  c.lora.dropout = 0.0
  c.optim.offload_state = True
  return c
