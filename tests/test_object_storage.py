"""Prepared corpora on object storage (jaxtrain/storage.py, data/sources/remote_tokens.py),
against an S3-compatible server started by the tests on the loopback interface
(tests/object_store.py): the path layer's reads and its one-line refusals, and a corpus read from
the bucket giving the batches the same corpus gives from local disk, batch for batch, resume
included."""

import importlib.util
from unittest import mock

import numpy as np
import pytest

from jaxtrain import data, storage
from jaxtrain.data import sources
from jaxtrain.data.prepare import prepare
from jaxtrain.data.sources import remote_tokens
from tests.data_helpers import (assert_batches_equal, assert_reads_like, make_docs,
                                source_config, take, write_jsonl)
from tests.object_store import s3_server, upload


@pytest.fixture(scope="module")
def s3():
  with s3_server() as (_, bucket):
    yield f"s3://{bucket}"


def _prepared(tmp_path, docs_per_shard=7):
  corpus = write_jsonl(tmp_path / "docs.jsonl", make_docs(60, seed=3))
  prepare(corpus, format="jsonl", tokenizer="byte", output=str(tmp_path / "prepared"),
          num_workers=1, docs_per_shard=docs_per_shard, log=None)
  return str(tmp_path / "prepared")


def test_the_path_layer_reads_a_bucket_like_local_files(s3, tmp_path):
  local = tmp_path / "blob.bin"
  local.write_bytes(bytes(range(256)) * 40)
  url = f"{s3}/paths/blob.bin"
  upload(str(tmp_path), f"{s3}/paths")
  assert storage.is_url(url) and not storage.is_url(str(local))
  for path in (str(local), url):
    assert storage.exists(path) and storage.isfile(path) and storage.size(path) == 10240
    assert storage.read_bytes(path) == local.read_bytes()
    assert storage.read_ranges(path, [(5, 9), (300, 302)]) == [bytes([5, 6, 7, 8]),
                                                               bytes([44, 45])]
  assert storage.isdir(f"{s3}/paths") and not storage.exists(f"{s3}/paths/none")


@pytest.mark.parametrize("url,words", [
    ("hdfs://cluster/data", ["'hdfs://'", "not supported", "s3://BUCKET"]),
    ("s3:///no-bucket", ["no bucket"]),
])
def test_urls_jaxtrain_cannot_read_are_one_line_errors(url, words):
  with pytest.raises(storage.StorageError) as err:
    storage.check_url(url, "data.train_paths")
  assert "\n" not in str(err.value) and str(err.value).startswith("data.train_paths: ")
  for word in words:
    assert word in str(err.value)


def test_a_missing_client_package_names_the_extra():
  real = importlib.util.find_spec
  with mock.patch.object(importlib.util, "find_spec",
                         lambda name, *a: None if name == "gcsfs" else real(name, *a)):
    with pytest.raises(storage.StorageError, match=r"needs the gcsfs package; install the cloud "
                                                   r"extra: pip install -e \"\.\[cloud\]\""):
      storage.check_url("gs://bucket/corpus")


def test_a_bucket_or_a_corpus_that_does_not_exist_is_one_line(s3):
  with pytest.raises(sources.DataError) as err:
    sources.PreparedCorpus("s3://no-such-bucket/corpus")
  assert "\n" not in str(err.value)
  assert "the bucket 'no-such-bucket' does not exist" in str(err.value)
  with pytest.raises(sources.DataError, match=f"{s3}/nothing has no manifest.json"):
    sources.PreparedCorpus(f"{s3}/nothing")


def test_a_corpus_read_from_the_bucket_gives_the_local_batches(s3, tmp_path):
  local = _prepared(tmp_path)
  url = f"{s3}/corpus"
  upload(local, url)
  here, there = sources.PreparedCorpus(local), sources.PreparedCorpus(url)
  assert there.remote and not here.remote
  np.testing.assert_array_equal(there.doc_lengths(), here.doc_lengths())
  pieces = data.piece_index(here.doc_lengths(), 16)
  pick = pieces[np.random.default_rng(0).permutation(len(pieces))[:300]]
  np.testing.assert_array_equal(there.read_pieces(pick), here.read_pieces(pick))
  for doc in (0, 17, len(here) - 1):
    np.testing.assert_array_equal(there.read(doc), here.read(doc))

  assert_reads_like(local, url)


def test_remote_reads_coalesce_into_one_range_per_run_of_blocks(s3, tmp_path):
  path = tmp_path / "tokens.bin"
  tokens = np.arange(5000, dtype="<u2")
  path.write_bytes(tokens.tobytes())
  upload(str(tmp_path), f"{s3}/blocks")
  url = f"{s3}/blocks/tokens.bin"
  cache = remote_tokens.BlockCache(max_bytes=1 << 20)
  remote = remote_tokens.RemoteTokens(url, np.dtype("<u2"), 5000, cache,
                                      block_bytes=1000)  # 500 tokens a block
  other = remote_tokens.RemoteTokens(url, np.dtype("<u2"), 5000, remote_tokens.BlockCache(),
                                     block_bytes=1000)  # another shard, as fetch sees it
  calls = []
  real = storage.read_ranges_many
  with mock.patch.object(storage, "read_ranges_many",
                         lambda requests: calls.append(list(requests)) or real(requests)):
    remote_tokens.fetch([(remote, 10, 20), (remote, 480, 1020), (remote, 4990, 5000),
                         (other, 2600, 2700)])
    np.testing.assert_array_equal(remote[480:1020], tokens[480:1020])
    np.testing.assert_array_equal(remote[4990:5000], tokens[4990:5000])
    np.testing.assert_array_equal(other[2600:2700], tokens[2600:2700])
  # One call for both shards: blocks 0-2 as one range, block 9 (the last, short) as another,
  # the other shard's block 5; the slices then hit the cache.
  assert calls == [[(url, 0, 3000), (url, 9000, 10000), (url, 5000, 6000)]]
  np.testing.assert_array_equal(remote[1999:2501], tokens[1999:2501])
  assert remote[7:7].size == 0


def test_the_stream_reads_a_bucket_corpus_ahead_of_the_step(s3, tmp_path):
  """The global stream hands its next pieces to the corpus on a background thread: the reader
  then finds them fetched, and the batches are those of local files."""
  url = f"{s3}/ahead"
  upload(_prepared(tmp_path), url)
  stream = data.make_train_iterator(source_config("prepared", url))
  local = source_config("prepared", str(tmp_path / "prepared"))
  assert_batches_equal(take(stream, 6), take(data.make_train_iterator(local), 6))
  assert stream.read_ahead is not None and stream.read_ahead.chunks_warmed > 0
  assert data.make_train_iterator(local).read_ahead is None  # local files: no thread




def test_the_read_ahead_thread_ends_with_its_stream(s3, tmp_path):
  url = f"{s3}/ahead-end"
  upload(_prepared(tmp_path), url)
  local = source_config("prepared", str(tmp_path / "prepared"))
  stream = data.make_train_iterator(source_config("prepared", url))
  batches = [next(stream)]
  thread = stream.read_ahead._thread  # pylint: disable=protected-access
  assert thread.is_alive()
  stream.close()
  thread.join(timeout=10)
  assert not thread.is_alive()
  batches.append(next(stream))  # reading again starts another, and goes on where it was
  assert stream.read_ahead._thread.is_alive()  # pylint: disable=protected-access
  stream.close()
  assert_batches_equal(batches, take(data.make_train_iterator(local), 2))
