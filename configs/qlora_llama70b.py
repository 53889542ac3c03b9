"""Llama 3.1 / 3.3 70B, QLoRA on four 24 GB RTX 4090s (rtx4090x4): fsdp over the NF4 base.

llama70b.py's architecture with sft_lora_llama8b.py's adapters, data and optimizer: rank-16
adapters on all seven projections (207M parameters) over a frozen base whose projections are
4-bit NormalFloat codes with one float32 scale per 256 inputs (32.9 GiB for 68.5B weights: 0.125
bits per weight of scales, 0.75 GiB per card less than groups of 64; qlora_qwen3_30b_a3b.py's
choice); embedding and head bfloat16, 3.9 GiB. fsdp over the four cards: 9.20 GiB of base per
card, each layer's codes gathered (4-bit, over PCIe) and dequantized one layer at a time. 32
sequences of 2048 tokens per step as 8 microbatches of one sequence per card, remat `full`, the
adapters' Adam moments in pinned host memory between steps, no adapter dropout.

`--dry_run` (XLA's GPU compiler, no device; jax 0.10.2, the CI's check_configs), per card: 19.07
GiB of 23.65 GiB (headroom +2.21 GiB under the 90% the verdict leaves to the runtime; jax 0.12's
compiler: 20.57 GiB, +0.72): parameters 9.77 GiB (adapters 0.57, base 9.20), temporaries 9.31
GiB; host (pinned) 1.13 GiB, the optimizer state (its transient device copies during the update
are not modelled by the deviceless compile). Collectives per step, an ESTIMATE from the compiled
HLO at PCIe 4.0's 31.5 GB/s: 505.7 GiB over the link (mostly the codes' all-gathers, forward and
recompute), ~17.2 s, against the matmuls' 6.25e15 FLOPs per card at 165 TFLOP/s, 37.9 s: the
collectives need 46% of the matmuls' time at peak. 4096-token sequences need 21.96 GiB under
fsdp (over the 90%: 21.29); with mesh.tensor=4 (and grad_accum_steps=32) 16.55 GiB, but the
activations' all-reduces then need 89% of the matmuls' time.

Other workstations (the same dry run with these overrides; --dry_run_target=... works too):

  a6000x2    --config.target=a6000x2: fits, 35.01 GiB of 47.54 (+7.78; jax 0.12: 35.94),
             microbatch 2 per card; collectives ~11.5 s at the PCIe rate against 80.2 s of
             matmuls (14%).
  rtx5090x2  --config.target=rtx5090x2 --config.mesh.fsdp=1 --config.mesh.tensor=2
             --config.train.grad_accum_steps=32: fits, 23.46 GiB of 31.37 (+4.77; jax 0.12:
             25.41); collectives ~11.5 s (activation all-reduces, PCIe 5.0) against 59.4 s of
             matmuls (19%). fsdp=2 does not fit (31.68 GiB at microbatch 1): XLA keeps a relaid
             copy of each card's whole w_down and wo codes and embedding shard (6.8 GiB).
  rtx4090x2  does not fit: the NF4 base alone is 18.40 GiB per card of the 21.29 GiB usable
             (mesh.tensor=2: 23.36 GiB; fsdp=2: 32.00 GiB). One or two 24 GB cards need the
             frozen base in host memory: qlora_llama70b_offload.py, planned, not yet shipped.

Loading, not yet possible on these cards: the trainer restores the whole bfloat16 base from
checkpoint.init_from onto the cards and quantizes it there (jaxtrain/train/loop.py,
_restore_or_init: load_params, then setup.make_frozen), so a start needs the bfloat16 base
(131 GiB: 32.9 GiB per 4090 of four, 65.7 GiB per card of two) beside its NF4 copy, and runs out
of device memory before the first step on every target above. Loading and quantizing the base
one tensor at a time would need 8.8 GiB per card at most on rtx4090x4 (w_gate or w_up's shard)
beside the 9.20 GiB of NF4 base, and 17.5 + 18.4 GiB on a6000x2; rtx5090x2 would need it a
layer at a time. The step's figures above stand as they are.

  python -m jaxtrain.interop.hf import --hf_dir=Llama-3.3-70B-Instruct --out=weights/llama70b \\
    --dtype=bfloat16
  python -m jaxtrain.main --config=configs/qlora_llama70b.py --workdir=runs/qlora_70b \\
    --config.checkpoint.init_from=weights/llama70b \\
    --config.data.tokenizer=hf:weights/llama70b/tokenizer.json \\
    --config.data.train_paths='chat/*.jsonl'
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "llama70b.py"))
  # Adapters, data, optimizer and checkpointing as sft_lora_llama8b.py has them.
  sft = load_config_file(os.path.join(HERE, "sft_lora_llama8b.py"))
  for group in ("lora", "data", "optim", "checkpoint", "train"):
    c[group] = sft[group]
  c.target = "rtx4090x4"
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  c.model.param_dtype = "bfloat16"  # what stays unquantized: embedding, head, norms
  c.model.remat_policy = "full"
  c.lora.quantize_base = "nf4"
  c.lora.quant_group_size = 256  # float32 scales: 0.125 bits per weight (64: 0.5)
  c.lora.dropout = 0.0
  c.optim.offload_state = True
  c.train.seq_len = 2048
  c.train.global_batch_size = 32
  c.train.grad_accum_steps = 8  # one sequence per card per microbatch
  c.train.loss_chunk_size = 512
  return c
