"""Exact resume of the input pipeline in a fresh process: N batches, save the iterator state,
M more; a new process restores the state and must produce the same M batches."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxtrain import data
from tests.test_data import small_config, take
from tests.test_data_prepared import _prepare
from tests.test_data_text import _jsonl, _texts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, M = 3, 4

# Runs in a fresh interpreter: rebuild the config, restore the state, write the next M batches.
RESTORE = """
import json, sys
import numpy as np
from jaxtrain import data
from tests.test_data import small_config

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
@pytest.mark.parametrize("workers", [0, 2])
def test_prepared_resume_in_fresh_process(tmp_path, workers):
  # The global stream reads in-process whatever data.num_workers says: the same batches.
  _, directory = _prepare(tmp_path)
  _resume_in_fresh_process(tmp_path, {"source": "prepared", "train_paths": str(directory),
                                      "num_workers": workers})


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_jsonl_resume_in_fresh_process(tmp_path, workers):
  path = _jsonl(tmp_path, _texts(300))
  _resume_in_fresh_process(tmp_path, {"source": "jsonl", "train_paths": str(path),
                                      "num_workers": workers})
