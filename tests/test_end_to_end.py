"""The CLI end to end: a short run whose loss falls, its outputs, a rerun in the same workdir,
training on freshly prepared shards. (Mesh-independence of a CLI run: tests/test_resume.py's
test_restore_on_another_mesh.)"""

import json
import os

import pytest

from tests.helpers import run_tiny

# The learning-rate schedule (compiled into the train step) of every run here: their train steps
# are one program, compiled once per session.
SCHEDULE = ["--config.optim.warmup_steps=10", "--config.optim.learning_rate=5e-3",
            "--config.optim.decay_steps=60"]


@pytest.mark.slow
def test_short_run_loss_falls_and_writes_metrics(tmp_path):
  proc, records = run_tiny(tmp_path, "--config.train.steps=60", "--config.train.log_every=10",
                           "--config.train.eval_every=30", *SCHEDULE)
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
def test_rerun_in_same_workdir_keeps_previous_metrics(tmp_path):
  """A second run from step 0 sets the first run's metrics.jsonl aside, byte for byte, and
  starts a file of its own steps only."""
  args = ["--config.train.steps=2", "--config.train.log_every=1", "--config.train.eval_every=2",
          *SCHEDULE]
  run_tiny(tmp_path, *args)
  first = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8")
  proc, records = run_tiny(tmp_path, *args)
  kept = tmp_path / "metrics.prev-1.jsonl"
  assert kept.read_text(encoding="utf-8") == first
  assert not os.path.exists(tmp_path / "metrics.prev-2.jsonl")
  assert f"{tmp_path / 'metrics.jsonl'} from an earlier run kept as {kept}" in proc.stdout
  # The new file: the second run's records alone (its steps once each), none of the first's.
  assert [r["step"] for r in records if "loss" in r] == [1, 2]
  assert [r["step"] for r in records if "eval_loss" in r] == [2]
  assert len(records) == len(first.splitlines())


@pytest.mark.slow
def test_prepare_then_train_on_the_shards(tmp_path):
  """JSONL + a freshly trained BPE → `python -m jaxtrain.data.prepare` → training from the
  shards (both CLIs, in this process)."""
  from jaxtrain.data import prepare  # pylint: disable=import-outside-toplevel
  from tests.data_helpers import make_docs, train_bpe, write_jsonl  # pylint: disable=import-outside-toplevel
  docs = make_docs(600)
  corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
  tokenizer = train_bpe(str(tmp_path / "tok"), docs)
  assert prepare.main(["--input", corpus, "--format=jsonl", f"--tokenizer=hf:{tokenizer}",
                       f"--output={tmp_path / 'prepared'}", "--num_workers=1"]) == 0
  with open(tmp_path / "prepared" / "manifest.json", encoding="utf-8") as f:
    assert json.load(f)["vocab_size"] <= 384
  _, records = run_tiny(tmp_path / "run", "--config.data.source=prepared",
                        f"--config.data.train_paths={tmp_path / 'prepared'}",
                        "--config.train.steps=40", "--config.train.log_every=10",
                        "--config.train.eval_every=40", *SCHEDULE)
  losses = [r["loss"] for r in records if "loss" in r]
  assert losses[-1] < losses[0] - 1.0, losses
  assert [r for r in records if "eval_loss" in r][-1]["eval_loss"] < 4.5
