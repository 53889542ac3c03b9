"""Tests for prepared corpora (flat token arrays written by `python -m jaxtrain.data.prepare`):
reads, slices, pickling, and one-line refusals of broken directories; no devices."""

import json
import os
import pickle

import numpy as np
import pytest

from jaxtrain.data import sources
from jaxtrain.data.sources import DataError


def token_docs(n, vocab, seed=0):
  """n documents of random ids below vocab, 0 to 299 tokens long (some empty)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, rng.integers(0, 300)).astype(np.int64) for _ in range(n)]


def write_prepared(root, shard_docs, dtype="<u4", vocab=128_256):
  """A prepared directory as `python -m jaxtrain.data.prepare` writes it; its documents."""
  root.mkdir(parents=True, exist_ok=True)
  entries = []
  for i, docs in enumerate(shard_docs):
    name = f"shard-{i:05d}-of-{len(shard_docs):05d}"
    n, t = sources.write_token_shard(str(root / name), docs, dtype)
    entries.append({"file": name, "documents": n, "tokens": t})
  manifest = {"version": 2, "token_dtype": dtype, "vocab_size": vocab,
              "tokenizer": "hf:/x/tokenizer.json", "shards": entries}
  (root / "manifest.json").write_text(json.dumps(manifest))
  return [np.asarray(d) for docs in shard_docs for d in docs]


@pytest.mark.parametrize("dtype,vocab", [("<u2", 65_536), ("<u4", 128_256)])
def test_prepared_write_read_round_trip(tmp_path, dtype, vocab):
  docs0, docs1 = token_docs(40, vocab, 0), token_docs(17, vocab, 1)
  docs0[3] = [0, 1, vocab - 1]  # a plain list, and the largest id of the vocab
  docs1[5] = np.array([], np.int32)
  n0, t0 = sources.write_token_shard(str(tmp_path / "s0"), iter(docs0), dtype)
  assert (n0, t0) == (40, sum(len(d) for d in docs0))
  expected = write_prepared(tmp_path / "corpus", [docs0, docs1], dtype, vocab)
  src = sources.PreparedCorpus(tmp_path / "corpus")
  assert len(src) == 57 and src.vocab_size == vocab and src.manifest["token_dtype"] == dtype
  for i, doc in enumerate(expected):
    got = src[i]
    assert got.dtype == np.int32 and got.flags.writeable
    np.testing.assert_array_equal(got, doc)
  np.testing.assert_array_equal(src[np.int64(41)], expected[41])  # grain passes numpy ints
  lengths = src.doc_lengths()
  assert lengths.dtype == np.int64
  np.testing.assert_array_equal(lengths, [len(d) for d in expected])
  assert src.num_tokens() == sum(len(d) for d in expected)
  assert src.describe() == (f"prepared: 2 shards, 57 documents, {src.num_tokens():,} tokens "
                            f"(tokenizer hf:/x/tokenizer.json)")


def test_prepared_slice_reads_equal_whole_document_reads(tmp_path):
  # The middle shard holds only empty documents: a 0-byte .bin, which cannot be memory-mapped.
  docs = write_prepared(tmp_path, [token_docs(30, 50_000, 2), [[], []], token_docs(25, 50_000, 3)],
                        dtype="<u2", vocab=50_000)
  src = sources.PreparedCorpus(str(tmp_path))
  rng = np.random.default_rng(0)
  for d, doc in enumerate(docs):
    n = len(doc)
    whole = src.read(d)
    np.testing.assert_array_equal(whole, doc)
    a, b = sorted(rng.integers(0, n + 1, 2))
    pairs = [(0, 0), (n, n), (0, n), (0, min(257, n)), (n // 3, 2 * n // 3), (a, b),
             (max(n - 1, 0), n)]
    for start, stop in pairs:
      piece = src.read(np.int64(d), start, stop)
      assert piece.dtype == np.int32 and piece.shape == (stop - start,)
      np.testing.assert_array_equal(piece, whole[start:stop])
    np.testing.assert_array_equal(src.read(d, n // 2), whole[n // 2:])  # stop=None: to the end
  longest = int(np.argmax(src.doc_lengths()))
  n = len(docs[longest])
  # A slice past the document's end would silently return the next document's tokens.
  with pytest.raises(IndexError, match=f"document {longest} has {n} tokens"):
    src.read(longest, 0, n + 1)
  with pytest.raises(IndexError, match="need 0 <= start <= stop"):
    src.read(longest, 5, 4)


def test_prepared_pickle_round_trip(tmp_path):
  docs = write_prepared(tmp_path, [token_docs(50, 128_256, 4), token_docs(50, 128_256, 5)])
  src = sources.PreparedCorpus(tmp_path)
  src.read(0)
  src.read(99)  # both shards mapped: the maps must not travel
  blob = pickle.dumps(src)
  token_bytes = 4 * src.num_tokens()
  assert len(blob) < token_bytes / 10, (len(blob), token_bytes)  # paths and offsets, no tokens
  copy = pickle.loads(blob)
  assert len(copy) == 100 and copy.describe() == src.describe()
  for d in [0, 49, 50, 99, 7]:
    np.testing.assert_array_equal(copy.read(d), docs[d])
    np.testing.assert_array_equal(copy.read(d, 1, max(len(docs[d]) - 1, 1)),
                                  src.read(d, 1, max(len(docs[d]) - 1, 1)))
  np.testing.assert_array_equal(copy.doc_lengths(), src.doc_lengths())


def test_write_token_shard_refusals_leave_no_files(tmp_path):
  prefix = str(tmp_path / "s")
  for docs, message in [
      ([[1, 2], [3, -1, 7]], r"document 1 has token ids in \[-1, 7\], outside \[0, 65535\] of "
                             r"uint16 \(<u2\)"),
      ([np.array([1, 70_000])], r"document 0 has token ids in \[1, 70000\]"),
      ([[1.5, 2.0]], "document 0 has token ids of dtype float64; token ids must be integers"),
      ([[[1, 2]]], r"document 0 has shape \(1, 2\); a document must be a 1-D"),
  ]:
    with pytest.raises(DataError, match=message):
      sources.write_token_shard(prefix, docs, "<u2")
    assert not os.listdir(tmp_path)  # the temporaries are removed
  with pytest.raises(ValueError, match="dtype='<i4'"):
    sources.write_token_shard(prefix, [[1]], "<i4")

  # A run that dies midway leaves an earlier complete shard as it was, not half replaced.
  assert sources.write_token_shard(prefix, [[1, 2, 3], []], "<u2") == (2, 3)
  before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}

  def dying():
    yield [4, 5]
    raise KeyboardInterrupt
  with pytest.raises(KeyboardInterrupt):
    sources.write_token_shard(prefix, dying(), "<u2")
  assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before


def _manifest_path(root):
  return root / "manifest.json"


def _edit_manifest(root, **changes):
  manifest = json.loads(_manifest_path(root).read_text())
  manifest.update(changes)
  _manifest_path(root).write_text(json.dumps(manifest))


def _break_no_manifest(root):
  os.remove(_manifest_path(root))


def _break_json(root):
  _manifest_path(root).write_text('{"version": 2, "shards": [')


def _break_old_version(root):
  """A version-1 corpus: ArrayRecord shards with .lengths.npy sidecars."""
  for name in os.listdir(root):
    os.remove(root / name)
  (root / "shard-00000-of-00001.arrayrecord").write_bytes(b"\x00" * 64)
  _manifest_path(root).write_text(json.dumps({
      "version": 1, "tokenizer": "hf:/tok/tokenizer.json", "input": ["a.jsonl", "b dir/*.jsonl"],
      "format": "jsonl", "field": "content", "add_bos": True, "add_eos": True,
      "shards": [{"file": "shard-00000-of-00001.arrayrecord", "documents": 2, "tokens": 8}]}))


def _break_foreign_bin(root):
  # Another tool's int32 tokens under a .bin name: the size does not match the uint16 index.
  starts = np.load(root / "shard-00001-of-00002.idx.npy")
  np.arange(starts[-1], dtype="<i4").tofile(root / "shard-00001-of-00002.bin")


def _break_truncated_bin(root):
  with open(root / "shard-00000-of-00002.bin", "r+b") as f:
    f.truncate(os.path.getsize(root / "shard-00000-of-00002.bin") - 2)


def _break_idx(starts):
  def breaker(root):
    np.save(root / "shard-00001-of-00002.idx.npy", starts)
  return breaker


def _break_idx_of_another_run(root):
  # All of the shard's tokens as one document: the .bin size fits, the manifest's count not.
  starts = np.load(root / "shard-00001-of-00002.idx.npy")
  np.save(root / "shard-00001-of-00002.idx.npy", np.array([0, starts[-1]], np.int64))


def _break_empty(root):
  for name in os.listdir(root):
    os.remove(root / name)
  write_prepared(root, [[], []])


BROKEN_CORPORA = {
    "missing path": (lambda root: None, "does not exist; name a directory written by "
                                        "python -m jaxtrain.data.prepare"),
    "no manifest": (_break_no_manifest, "has no manifest.json: not a prepared corpus, or its "
                                        "prepare run did not finish; run python -m "
                                        "jaxtrain.data.prepare ... --output"),
    "bad json": (_break_json, "cannot read it as JSON"),
    "version 1": (_break_old_version, "version 1 manifest: these shards are the old ArrayRecord "
                                      "format, read whole document by document"),
    "version 3": (lambda root: _edit_manifest(root, version=3), "manifest version 3, but this "
                                                                "jaxtrain reads version 2"),
    "bad dtype": (lambda root: _edit_manifest(root, token_dtype="<i8"), "token_dtype '<i8'"),
    "missing bin": (lambda root: os.remove(root / "shard-00001-of-00002.bin"),
                    "lists shard-00001-of-00002, but shard-00001-of-00002.bin is missing"),
    "missing idx": (lambda root: os.remove(root / "shard-00000-of-00002.idx.npy"),
                    "shard-00000-of-00002.idx.npy is missing"),
    "foreign bin": (_break_foreign_bin, "truncated .* or written by another tool"),
    "truncated bin": (_break_truncated_bin, "shard-00000-of-00002.bin: .* bytes, but its index "
                                            "ends at"),
    "float idx": (_break_idx(np.array([0.0, 3.0])), "an array of dtype float64 and shape"),
    "2-D idx": (_break_idx(np.zeros((2, 2), np.int64)), r"an array of dtype int64 and shape \(2, 2\)"),
    "idx from 5": (_break_idx(np.array([5, 9], np.int64)), "offsets starting at 5, not 0"),
    "decreasing idx": (_break_idx(np.array([0, 4, 2, 6], np.int64)),
                       "decreasing offsets .first at entry 2"),
    "idx of another run": (_break_idx_of_another_run, "1 documents and .* tokens, but "
                                                      "manifest.json lists 4 .*mixes files of "
                                                      "different prepare runs"),
    "no documents": (_break_empty, "empty corpus: its 2 shards hold no documents"),
}


@pytest.mark.parametrize("case", list(BROKEN_CORPORA))
def test_prepared_refusals_are_one_line(tmp_path, case):
  root = tmp_path / "corpus"
  write_prepared(root, [token_docs(5, 1000, 6), token_docs(4, 1000, 7)], dtype="<u2", vocab=1000)
  breaker, message = BROKEN_CORPORA[case]
  path = tmp_path / "elsewhere" if case == "missing path" else root
  breaker(root)
  with pytest.raises(DataError, match=message) as e:
    sources.PreparedCorpus(path, what="eval_paths")
  assert "\n" not in str(e.value)
  assert str(e.value).startswith("data.eval_paths: ")  # names the config key ...
  assert str(path) in str(e.value)  # ... and the path
  if case == "version 1":
    assert str(e.value).endswith(
        "python -m jaxtrain.data.prepare --input a.jsonl 'b dir/*.jsonl' --format jsonl --field "
        "content --tokenizer hf:/tok/tokenizer.json --add_bos --output NEW_DIR")


def test_prepared_names_directory_not_glob_or_shard(tmp_path, monkeypatch):
  write_prepared(tmp_path, [token_docs(3, 1000, 8)])
  for given, message in [(str(tmp_path / "*.bin"), "is a glob; name the prepared directory"),
                         (str(tmp_path / "shard-00000-of-00001.bin"), "is a file, not a prepared "
                                                                       "corpus")]:
    with pytest.raises(DataError, match=message) as e:
      sources.PreparedCorpus(given)
    assert "\n" not in str(e.value) and str(e.value).startswith("data.train_paths: ")
  monkeypatch.setenv("HOME", str(tmp_path.parent))
  assert len(sources.PreparedCorpus(f"~/{tmp_path.name}")) == 3  # `~` is expanded
