"""Fine-tuning end to end through the CLI (in this process, tests.helpers.run_cli): the tiny SFT
and DPO configs train (loss falls, DPO's reward accuracy rises) and resume exactly, the frozen
DPO reference rebuilt on resume."""

import json
import os
import shutil

import numpy as np
import pytest

from jaxtrain.interop import hf
from tests.helpers import absl_cli_module, run_cli, run_entry


def _run(config, workdir, *overrides):
  proc = run_cli(f"--config=configs/{config}", f"--workdir={workdir}", *overrides)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  return proc.stdout, train, evals


@pytest.mark.slow(seconds=20)
def test_sft_then_lora_then_qlora_from_it(tmp_path):
  """Full SFT makes a base; sft_lora_tiny and qlora_tiny fine-tune it further (the held-out loss
  on completions drops below the base's), checkpointing only adapters; generation and export
  see the adapters merged into the base."""
  # Rows of 64 tokens and one eval batch: a quarter of the configs' work per step.
  short = ("--config.train.seq_len=64", "--config.train.loss_chunk_size=64",
           "--config.train.eval_batches=1")
  # A base ten steps in, with room left for the adapters to improve it.
  out, train, evals = _run("sft_tiny.py", tmp_path / "sft", *short, "--config.train.steps=10",
                           "--config.optim.warmup_steps=3", "--config.train.log_every=1",
                           "--config.train.eval_every=10", "--config.checkpoint.every_steps=10")
  assert "whole records" in out and "packing efficiency" in out
  assert train[-1]["loss"] < train[0]["loss"] - 0.8, [r["loss"] for r in train]
  base, base_eval = tmp_path / "sft", evals[-1]["eval_loss"]
  sizes = {}
  for config in ("sft_lora_tiny.py", "qlora_tiny.py"):
    workdir = tmp_path / config.split(".")[0]
    out, _, evals = _run(config, workdir, *short, "--config.train.steps=8",
                         "--config.optim.warmup_steps=4", "--config.train.eval_every=8",
                         "--config.checkpoint.every_steps=8",
                         f"--config.checkpoint.init_from={base}")
    assert "adapter params" in out and f"frozen base weights from {base}" in out
    # The same held-out records as the base's eval: the adapters improve on it (by 0.014 nats
    # here; adapters that did not train would leave it exactly unchanged).
    assert evals[-1]["eval_loss"] < base_eval - 0.01, (config, evals, base_eval)
    sizes[config] = sum(f.stat().st_size for f in (workdir / "checkpoints" / "8").rglob("*")
                        if f.is_file())
  assert "stored nf4" in out
  full = sum(f.stat().st_size for f in (base / "checkpoints" / "10").rglob("*") if f.is_file())
  assert sizes["sft_lora_tiny.py"] < full / 4, (sizes, full)  # adapters and their Adam moments

  # Generation loads the run's adapters merged into its base (named by the saved config);
  # export (`python -m jaxtrain.interop.hf export`) writes that merged model without --config,
  # and transformers' format holds it whole.
  with absl_cli_module("jaxtrain.generate.cli") as generate_cli:
    merged, _ = generate_cli.load(str(tmp_path / "qlora_tiny"))
  proc = run_entry(hf.main, "export", f"--checkpoint={tmp_path / 'qlora_tiny'}",
                   f"--out={tmp_path / 'hf'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  exported, _ = hf.load_model(str(tmp_path / "hf"))
  tokens = np.arange(24, dtype=np.int32).reshape(2, 12) + 97
  np.testing.assert_allclose(np.asarray(exported(tokens)), np.asarray(merged(tokens)),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.slow(seconds=20)
def test_dpo_reward_accuracy_rises_and_resume_is_exact(tmp_path):
  steps = ["--config.train.log_every=4", "--config.train.eval_every=12",
           "--config.optim.decay_steps=24", "--config.checkpoint.every_steps=12"]
  out, train, evals = _run("dpo_tiny.py", tmp_path / "whole", *steps, "--config.train.steps=24")
  assert "preference pairs" in out and "DPO, beta 0.1" in out
  # At step 0 the policy is the reference: every margin is 0 and no pair counts as won. Each
  # logged value is one batch of 16 pairs, so the check averages the last three.
  accuracy = [r["reward_accuracy"] for r in train]
  assert sum(accuracy[-3:]) / 3 > 0.7, accuracy
  assert train[-1]["loss"] < train[0]["loss"] < 0.7
  assert evals[-1]["eval_reward_accuracy"] > 0.75 and evals[-1]["eval_reward_margin"] > 0
  for key in ("chosen_rewards", "rejected_rewards", "reward_margin"):
    assert key in train[-1]

  # Resumed from the run's step-12 checkpoint (what a run stopped at 12 leaves, copied rather
  # than trained again): the reference is rebuilt (here from the seed's random init) and the
  # run continues step for step, bitwise on CPU: the same loss, gradient norm and rewards at
  # every logged step after 12.
  shutil.copytree(tmp_path / "whole" / "checkpoints" / "12",
                  tmp_path / "split" / "checkpoints" / "12")
  out, resumed, _ = _run("dpo_tiny.py", tmp_path / "split", *steps, "--config.train.steps=24")
  assert "resumed from step 12" in out
  keys = ("step", "loss", "grad_norm", "reward_accuracy", "reward_margin", "chosen_rewards",
          "rejected_rewards")
  want = [tuple(r[k] for k in keys) for r in train if r["step"] > 12]
  assert [w[0] for w in want] == [16, 20, 24]
  assert [tuple(r[k] for k in keys) for r in resumed] == want
