"""The CLI end to end: a short run whose loss falls, its outputs, and mesh-independence."""

import json
import os

import numpy as np
import pytest

from tests.helpers import run_main

# A smaller, faster variant of configs/tiny.py (same code path).
SMALL = ["--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.mlp_dim=128",
         "--config.model.num_heads=4", "--config.model.num_kv_heads=2",
         "--config.model.head_dim=16", "--config.train.seq_len=64",
         "--config.train.global_batch_size=8", "--config.train.eval_batches=2"]


def _run(workdir, *overrides, devices=1):
  proc = run_main("--config=configs/tiny.py", f"--workdir={workdir}", *SMALL, *overrides,
                  devices=devices)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return proc, records


@pytest.mark.slow
def test_short_run_loss_falls_and_writes_metrics(tmp_path):
  proc, records = _run(tmp_path, "--config.train.steps=60", "--config.train.log_every=10",
                       "--config.train.eval_every=30", "--config.optim.warmup_steps=10",
                       "--config.optim.learning_rate=5e-3")
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]
  assert [r["step"] for r in evals] == [30, 60]
  for r in train:
    for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_sec", "mfu"):
      assert key in r, key
  assert train[-1]["loss"] < train[0]["loss"] - 0.5
  assert evals[-1]["eval_loss"] < 3.15  # below the byte-unigram entropy (3.25 nats)
  assert train[-1]["tokens_per_sec"] > 0 and 0 < train[-1]["mfu"] < 1
  out = proc.stdout
  assert "parameters" in out and "FLOPs per token" in out and "packing efficiency" in out
  assert "tok/s" in out and "MFU" in out and "ETA" in out
  assert os.listdir(tmp_path / "tensorboard")


@pytest.mark.slow
def test_2x2x2_mesh_matches_one_device_for_10_steps(tmp_path):
  steps = ["--config.train.steps=10", "--config.train.log_every=1", "--config.train.eval_every=10",
           "--config.optim.warmup_steps=2"]
  _, one = _run(tmp_path / "one", *steps)
  _, eight = _run(tmp_path / "eight", *steps, "--config.mesh.data=2", "--config.mesh.fsdp=2",
                  "--config.mesh.tensor=2", devices=8)
  loss_one = [r["loss"] for r in one if "loss" in r]
  loss_eight = [r["loss"] for r in eight if "loss" in r]
  assert len(loss_one) == 10
  np.testing.assert_allclose(loss_eight, loss_one, rtol=2e-5)


@pytest.mark.slow
def test_rerun_in_same_workdir_keeps_previous_metrics(tmp_path):
  args = ["--config.train.steps=2", "--config.train.log_every=1", "--config.train.eval_every=2"]
  _run(tmp_path, *args)
  proc, records = _run(tmp_path, *args)
  assert [r["step"] for r in records if "loss" in r] == [1, 2]
  assert os.path.exists(tmp_path / "metrics.prev-1.jsonl")
  assert "kept as" in proc.stdout


@pytest.mark.slow
def test_prepare_then_train_on_the_shards(tmp_path):
  """JSONL + a freshly trained BPE → `jaxtrain.data.prepare` → training from the shards."""
  from jaxtrain.data.prepare import prepare  # pylint: disable=import-outside-toplevel
  from tests.test_prepare import make_docs, train_bpe, write_jsonl  # pylint: disable=import-outside-toplevel
  docs = make_docs(600)
  corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
  tokenizer = train_bpe(str(tmp_path / "tok"), docs)
  manifest = prepare(corpus, format="jsonl", tokenizer=f"hf:{tokenizer}",
                     output=str(tmp_path / "prepared"), num_workers=1, log=None)
  assert manifest["vocab_size"] <= 384
  _, records = _run(tmp_path / "run", "--config.data.source=prepared",
                    f"--config.data.train_paths={tmp_path / 'prepared'}",
                    "--config.train.steps=40", "--config.train.log_every=10",
                    "--config.train.eval_every=40", "--config.optim.warmup_steps=5",
                    "--config.optim.learning_rate=5e-3")
  losses = [r["loss"] for r in records if "loss" in r]
  assert losses[-1] < losses[0] - 1.0, losses
  assert [r for r in records if "eval_loss" in r][-1]["eval_loss"] < 4.5
