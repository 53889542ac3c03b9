"""gs:// end to end, against the GCS emulator the tests start on the loopback interface
(tests/gcs_store.py): the path layer (jaxtrain/storage.py through gcsfs), a prepared corpus read
from a bucket giving the local batches, weights saved to and loaded from a bucket, and runs with
their workdir on a bucket (checkpoints written by Orbax itself, through TensorStore's gcs driver
and etils epath): SIGKILLed and resumed bitwise, and never resumed from a step that is
uncommitted or corrupted."""

import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from jaxtrain import data, storage
from jaxtrain.checkpointing import mirror as checkpoint_mirror, weights as checkpoint_weights
from jaxtrain.data import sources
from jaxtrain.data.prepare import prepare
from tests.data_helpers import assert_reads_like, make_docs, write_jsonl
from tests.gcs_store import gcs_server, upload
from tests.helpers import REPO, SMALL_TINY_ARGS, main_command, main_env, run_cli, run_tiny

STEPS = 12
COMMON = [f"--config.train.steps={STEPS}", "--config.train.log_every=1",
          "--config.train.eval_every=6", "--config.optim.warmup_steps=2",
          "--config.checkpoint.every_steps=4"]


@pytest.fixture(scope="module")
def gs():
  with gcs_server() as (_, bucket):
    yield f"gs://{bucket}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The same run on local disk, uninterrupted: what every bucket run must equal, bitwise."""
  _, records = run_tiny(tmp_path_factory.mktemp("local"), *COMMON)
  return records


def test_the_path_layer_reads_and_writes_a_bucket_like_local_files(gs, tmp_path):
  local = tmp_path / "tree"
  (local / "sub").mkdir(parents=True)
  (local / "blob.bin").write_bytes(bytes(range(256)) * 40)
  (local / "sub" / "note.txt").write_bytes(b"note")
  (local / "last.json").write_bytes(b"{}")
  url = f"{gs}/paths"
  assert sorted(storage.upload_dir(str(local), url, last=("last.json",))) == [
      "blob.bin", "last.json", os.path.join("sub", "note.txt")]
  blob = f"{url}/blob.bin"
  assert storage.exists(blob) and storage.isfile(blob) and storage.size(blob) == 10240
  assert storage.read_bytes(blob) == (local / "blob.bin").read_bytes()
  assert storage.read_ranges(blob, [(5, 9), (300, 302)]) == [bytes([5, 6, 7, 8]), bytes([44, 45])]
  assert storage.isdir(url) and storage.isdir(f"{url}/sub") and not storage.isdir(blob)
  assert not storage.exists(f"{url}/none") and storage.listdir(f"{url}/none") == []
  assert storage.listdir(url) == ["blob.bin", "last.json", "sub"]
  size, version = storage.object_version(blob)
  assert size == 10240 and version
  assert [u for u, *_ in storage.glob_objects(f"{url}/**/*.txt")] == [f"{url}/sub/note.txt"]

  back = tmp_path / "back"
  assert sorted(storage.download_dir(url, str(back), exclude=("sub",))) == ["blob.bin",
                                                                            "last.json"]
  assert (back / "blob.bin").read_bytes() == (local / "blob.bin").read_bytes()
  storage.remove_tree(url)
  assert not storage.exists(blob) and storage.listdir(url) == []


def test_a_bucket_that_does_not_exist_is_one_line(gs, tmp_path, monkeypatch):
  """gcsfs answers any 404 with a bare FileNotFoundError: a missing bucket is still named."""
  with pytest.raises(sources.DataError) as err:
    sources.PreparedCorpus("gs://no-such-bucket/corpus")
  assert "\n" not in str(err.value)
  assert "the bucket 'no-such-bucket' does not exist" in str(err.value)
  monkeypatch.chdir(tmp_path)
  proc = run_cli(f"--config={REPO}/configs/tiny.py", "--workdir=gs://no-such-bucket/run",
                 cwd=tmp_path)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "config error: --workdir: gs://no-such-bucket/run: the bucket 'no-such-bucket' does not "
      "exist"), proc.stderr
  assert os.listdir(tmp_path) == []


def test_a_corpus_read_from_the_bucket_gives_the_local_batches(gs, tmp_path):
  corpus = write_jsonl(tmp_path / "docs.jsonl", make_docs(60, seed=3))
  local = str(tmp_path / "prepared")
  prepare(corpus, format="jsonl", tokenizer="byte", output=local, num_workers=1,
          docs_per_shard=7, log=None)
  url = f"{gs}/corpus"
  upload(local, url)
  here, there = sources.PreparedCorpus(local), sources.PreparedCorpus(url)
  assert there.remote and not here.remote
  np.testing.assert_array_equal(there.doc_lengths(), here.doc_lengths())
  pieces = data.piece_index(here.doc_lengths(), 16)
  pick = pieces[np.random.default_rng(0).permutation(len(pieces))[:300]]
  np.testing.assert_array_equal(there.read_pieces(pick), here.read_pieces(pick))

  assert_reads_like(local, url)


def test_weights_on_a_bucket_are_written_and_read_by_orbax_directly(gs):
  """save_params and load_params on gs:// go through Orbax itself (no staging copy)."""
  params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  assert checkpoint_weights.save_params(f"{gs}/weights", params) == f"{gs}/weights/params"
  assert "params" in storage.listdir(f"{gs}/weights")
  loaded, item = checkpoint_weights.load_params(f"{gs}/weights", abstract)
  assert item == f"{gs}/weights/params"
  assert all(np.array_equal(np.asarray(loaded[k]), params[k]) for k in params)


def _complete(url) -> list[int]:
  """The steps of `url`'s checkpoints that Orbax committed: on GCS, where there is no atomic
  rename, its marker in the step directory says the step is whole. Listed afresh: a run in this
  process (its workdir's pull) leaves listings in gcsfs's cache that Orbax's writes, through
  another client, do not update."""
  steps = [int(n) for n in storage.listdir(f"{url}/checkpoints") if n.isdigit()]
  return sorted(s for s in steps if checkpoint_mirror.COMMIT_MARKER in storage.listdir(
      f"{url}/checkpoints/{s}"))


def _run_on(url, *overrides):
  proc = run_cli("--config=configs/tiny.py", f"--workdir={url}", *SMALL_TINY_ARGS, *overrides)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc


def _records(url) -> list[dict]:
  return [json.loads(l) for l in storage.read_bytes(f"{url}/metrics.jsonl").decode().splitlines()]


def _history(records):
  return ([(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r],
          [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r])


@pytest.mark.slow(seconds=25)
def test_a_killed_run_on_a_bucket_resumes_bitwise(gs, uninterrupted, tmp_path, monkeypatch):
  """--workdir=gs://...: SIGKILLed once the bucket holds a committed checkpoint, resumed on a
  machine without the local files, the run equals an uninterrupted local one, bitwise."""
  url = f"{gs}/killed"
  proc = subprocess.Popen(main_command("--config=configs/tiny.py", f"--workdir={url}",
                                       *SMALL_TINY_ARGS, *COMMON),
                          cwd=REPO, env=main_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not _complete(url):
      time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  complete = _complete(url)
  assert complete and complete[-1] < STEPS

  monkeypatch.setenv(storage.STAGING_ENV, str(tmp_path / "new-node"))  # no local files left
  resumed = _run_on(url, *COMMON)
  assert f"resumed from step {complete[-1]}: {url}/checkpoints/{complete[-1]}" in resumed.stdout
  train, evals = _history(_records(url))
  want_train, want_evals = _history(uninterrupted)
  assert [s for s, *_ in train] == list(range(1, STEPS + 1))  # each step once
  assert train == want_train  # losses and gradient norms bitwise equal
  assert evals == want_evals
  assert _complete(url) == [4, 8, 12]  # retention (max_to_keep=3), Orbax's own on the bucket
  assert storage.listdir(f"{url}/checkpoints") == ["12", "4", "8"]
  assert any(n.startswith("events") for n in storage.listdir(f"{url}/tensorboard"))


@pytest.mark.slow(seconds=15)
def test_an_uncommitted_or_corrupted_step_is_never_taken(gs, uninterrupted, tmp_path,
                                                         monkeypatch):
  """The newest step lost its marker and part of its files (a save cut short on GCS, where
  Orbax writes the step in place): the resumed run starts from the step before it, saves the
  step again over the leftovers, and still equals the uninterrupted run. Then the newest step,
  committed, loses its arrays: it is set aside (renamed on the bucket) and the run resumes from
  the step before it, equal again."""
  url = f"{gs}/cut"
  _run_on(url, *COMMON)
  assert _complete(url) == [4, 8, 12]
  storage.remove_tree(f"{url}/checkpoints/12/{checkpoint_mirror.COMMIT_MARKER}")
  storage.remove_tree(f"{url}/checkpoints/12/state")
  assert _complete(url) == [4, 8]
  monkeypatch.setenv(storage.STAGING_ENV, str(tmp_path / "new-node"))
  assert "resumed from step 8:" in _run_on(url, *COMMON).stdout
  assert _history(_records(url)) == _history(uninterrupted)
  assert _complete(url) == [4, 8, 12]  # step 12 saved again, whole

  storage.remove_tree(f"{url}/checkpoints/12/state/ocdbt.process_0")
  monkeypatch.setenv(storage.STAGING_ENV, str(tmp_path / "another-node"))
  proc = _run_on(url, *COMMON)
  assert f"warning: checkpoint {url}/checkpoints/12 is incomplete or corrupted" in proc.stdout
  assert "resumed from step 8:" in proc.stdout
  assert _history(_records(url)) == _history(uninterrupted)
  assert _complete(url) == [4, 8, 12]
  aside = [n for n in storage.listdir(f"{url}/checkpoints") if n.startswith("12.corrupted-")]
  assert len(aside) == 1 and storage.isdir(f"{url}/checkpoints/{aside[0]}/meta")
