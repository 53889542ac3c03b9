"""A weighted mixture of sources (data.mixture)."""


import ml_collections
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.config import ConfigError
from jaxtrain.data import sources
from tests.data_helpers import assert_resumes, small_config, take, texts_jsonl

MARK = "\u00e9"  # JSONL documents are all é (bytes 0xC3 0xA9): easy to tell from stdlib code


def _config(tmp_path, code_weight, jsonl_weight):
  path = texts_jsonl(tmp_path, [MARK * 200] * 50)
  c = small_config()
  c.data.mixture = ml_collections.ConfigDict({
      "code": {"source": "stdlib_bytes", "weight": code_weight},
      "prose": {"source": "jsonl", "train_paths": str(path), "weight": jsonl_weight},
  })
  return c


def _prose_fraction(batches):
  rows = [r for b in batches for r in b["inputs"]]
  return np.mean([bool(np.isin(r[:8], [0xC3, 0xA9]).all()) for r in rows])


def test_pieces_follow_the_weights(tmp_path):
  batches = take(data.make_train_iterator(_config(tmp_path, 0.25, 0.75)), 40)
  assert 0.6 < _prose_fraction(batches) < 0.9  # 160 rows of mostly single pieces
  batches = take(data.make_train_iterator(_config(tmp_path, 0.75, 0.25)), 40)
  assert 0.1 < _prose_fraction(batches) < 0.4


def test_mixture_resumes_exactly(tmp_path):
  c = _config(tmp_path, 0.5, 0.5)
  assert_resumes(c)
  assert len(data.make_eval_batches(c)) == c.train.eval_batches


@pytest.mark.parametrize("weight", [0.0, -1.0])
def test_zero_or_negative_weight_is_named(tmp_path, weight):
  with pytest.raises(sources.DataError, match=r"weight of source 'prose'.*> 0"):
    data.make_train_iterator(_config(tmp_path, 0.5, weight))


def test_component_without_weight_or_with_unknown_key(tmp_path):
  c = _config(tmp_path, 0.5, 0.5)
  del c.data.mixture.code["weight"]
  with pytest.raises(ConfigError, match="data.mixture.code: has no weight"):
    data.make_train_iterator(c)
  c = _config(tmp_path, 0.5, 0.5)
  c.data.mixture.code.paths = "x"
  with pytest.raises(ConfigError, match=r"data.mixture.code: unknown keys \['paths'\]"):
    data.make_train_iterator(c)
