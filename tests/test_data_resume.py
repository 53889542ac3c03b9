"""Exact resume of the input pipeline in a fresh process: N batches, save the iterator state,
M more; a new process restores the state and must produce the same M batches.

The fresh interpreter is the point (the same restore within one process is tested by
tests/test_data.py's assert_resumes for each source): it has never built the iterator and holds
no module-level cache of it, and (PYTHONHASHSEED unset) it hashes strings with another seed, so
a state that leans on any of these fails here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.data.prepare import prepare
from tests.data_helpers import small_config, take
from tests.data_helpers import GREEK_WORDS as WORDS
from tests.data_helpers import make_docs, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, M = 3, 4

# Runs in a fresh interpreter: rebuild the config, restore the state, write the next M batches.
RESTORE = """
import json, sys
import numpy as np
from jaxtrain import data
from tests.data_helpers import small_config

def main():
  overrides, state_path, out_path, m = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
  c = small_config()
  for k, v in json.loads(overrides).items():
    c.data[k] = v
  it = data.make_train_iterator(c)
  with open(state_path) as f:
    it.set_state(json.load(f))
  batches = [next(it) for _ in range(m)]
  np.savez(out_path, **{f"{i}_{k}": v for i, b in enumerate(batches) for k, v in b.items()})
  if hasattr(it, "close"):
    it.close()

if __name__ == "__main__":
  main()
"""


def _resume_in_fresh_process(tmp_path, overrides):
  c = small_config()
  for k, v in overrides.items():
    c.data[k] = v
  it = data.make_train_iterator(c)
  take(it, N)
  state_path = tmp_path / "state.json"
  state_path.write_text(json.dumps(it.get_state()))
  expected = take(it, M)
  if hasattr(it, "close"):
    it.close()
  script = tmp_path / "restore.py"
  script.write_text(RESTORE)
  out = tmp_path / "resumed.npz"
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(script), json.dumps(overrides), str(state_path),
                         str(out), str(M)], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = np.load(out)
  for i, batch in enumerate(expected):
    for k, v in batch.items():
      np.testing.assert_array_equal(got[f"{i}_{k}"], v, err_msg=f"batch {i} {k}")


@pytest.mark.slow
def test_stdlib_resume_in_fresh_process(tmp_path):
  _resume_in_fresh_process(tmp_path, {})


@pytest.mark.slow
def test_prepared_resume_in_fresh_process(tmp_path):
  # One global stream, read in-process whatever data.num_workers says: no workers to vary.
  corpus = write_jsonl(tmp_path / "prepared.jsonl", make_docs(80))
  prepare(corpus, format="jsonl", tokenizer="byte", output=str(tmp_path / "prepared"),
          num_workers=1, docs_per_shard=30, log=None)
  _resume_in_fresh_process(tmp_path, {"source": "prepared",
                                      "train_paths": str(tmp_path / "prepared")})


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_jsonl_resume_in_fresh_process(tmp_path, workers):
  # Raw text goes through grain, with data.num_workers worker processes: both ways.
  rng = np.random.default_rng(0)
  texts = [" ".join(rng.choice(WORDS, int(rng.integers(5, 80)))) + " é" for _ in range(300)]
  path = tmp_path / "corpus.jsonl"
  path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)),
                  encoding="utf-8")
  _resume_in_fresh_process(tmp_path, {"source": "jsonl", "train_paths": str(path),
                                      "num_workers": workers})
