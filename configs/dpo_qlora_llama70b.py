"""Llama 3.1 / 3.3 70B, DPO over the QLoRA base of qlora_llama70b.py on four RTX 4090s (rtx4090x4).

The policy is the NF4 base plus rank-16 adapters, fsdp over the four cards as in
qlora_llama70b.py; only the adapters train. The reference is that same base with the adapters
off, not a second copy: under LoRA the trainer keeps one frozen tree, `Frozen(base=...)`, with
`reference=None` (jaxtrain/train/setup.py, `build`), and the DPO loss runs the reference as
the same model with zero adapters over that frozen base (jaxtrain/objectives/base.py,
`reference_model`); tests/test_shipped_configs.py checks both on this config at toy size. The
reference costs one more forward pass per microbatch and no weights of its own. Preference
records as dpo_llama8b.py reads them: JSONL {"prompt", "chosen", "rejected"}.

Each side of a pair is a row of train.seq_len + 1 = 768 tokens (prompt and response; cuDNN
attention needs an even length); 32 pairs per step as 8 microbatches of one pair (two rows) per
card, remat `full`, the adapters' Adam moments in pinned host memory. `--dry_run` (XLA's GPU
compiler, no device; jax 0.10.2, the CI's check_configs), per card: 18.16 GiB of 23.65 GiB
(headroom +3.12 GiB under the 90% the verdict leaves to the runtime; jax 0.12's compiler: 19.89
GiB, +1.39): parameters 9.77 GiB (adapters 0.57, base 9.20), temporaries 8.40 GiB; host (pinned)
1.13 GiB, the optimizer state. Collectives per step, an ESTIMATE from the compiled HLO at PCIe
4.0's 31.5 GB/s: 703.1 GiB over the link (the codes' all-gathers for the reference's forward,
the policy's forward and its recompute), ~24.0 s, against the matmuls' 6.43e15 FLOPs per card at
165 TFLOP/s, 38.9 s: 62% of the matmuls' time at peak.

Longer rows: 1024 tokens (--config.train.seq_len=1023) fit under jax 0.10.2 (19.25 GiB; the
collectives then 46% of the matmuls) but not under jax 0.12, whose compiler gathers the whole
head and embedding at once (22.22 GiB); 2048 (seq_len=2047) fit neither (21.75 GiB under 0.10.2).
Two RTX A6000s take rows of 2048 as one pair per card (--config.target=a6000x2
--config.train.seq_len=2047 --config.train.grad_accum_steps=16: 34.85 GiB of 47.54, jax 0.12
37.07; collectives ~36.2 s at the PCIe rate against 220 s of matmuls, 16%); two RTX 5090s rows
of 1024 under tensor parallelism (--config.target=rtx5090x2 --config.mesh.fsdp=1
--config.mesh.tensor=2 --config.train.grad_accum_steps=32 --config.train.seq_len=1023: 23.43 GiB
of 31.37, jax 0.12 25.36; ~14.2 s against 81.5 s, 17%).

Starting a run has qlora_llama70b.py's limit: the trainer loads the whole bfloat16 base onto
the cards before quantizing it, more than these cards hold (its docstring has the figures).

  python -m jaxtrain.main --config=configs/dpo_qlora_llama70b.py --workdir=runs/dpo_qlora_70b \\
    --config.checkpoint.init_from=weights/llama70b \\
    --config.data.tokenizer=hf:weights/llama70b/tokenizer.json \\
    --config.data.train_paths='prefs/*.jsonl'
"""

import os

from jaxtrain.config import load_config_file

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
  c = load_config_file(os.path.join(HERE, "qlora_llama70b.py"))
  dpo = load_config_file(os.path.join(HERE, "dpo_llama8b.py"))
  c.train.objective = "dpo"
  c.dpo = dpo.dpo  # beta 0.1
  c.data = dpo.data  # preference JSONL, 2% held out
  c.train.seq_len = 767  # rows of 768 tokens (1024 fit jax 0.10.2's compile only)
  c.train.global_batch_size = 32  # preference pairs per step
  c.train.grad_accum_steps = 8  # one pair (two rows) per card per microbatch
  c.train.steps = 1000
  c.train.eval_every = 100
  # Adapters move the policy through far fewer parameters than dpo_llama8b.py's full weights
  # (5e-7): a LoRA rate, below the SFT adapters' 2e-4.
  c.optim.learning_rate = 5e-6
  c.optim.warmup_steps = 50
  c.optim.min_lr_ratio = 0.0
  c.checkpoint.every_steps = 100
  return c
