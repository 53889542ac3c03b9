"""Tests for the document sources (text, JSONL, Parquet, prepared token arrays); no devices."""

import concurrent.futures
import json
import os
import pickle
import re

import grain
import numpy as np
import pytest

from jaxtrain.data import sources
from jaxtrain.data.sources import DataError

DOCS = ["hello world", "zweite Zeile: äöü ß", "日本語のテキスト 🚀", "",
        "tab\there\nand a newline"]


def write_jsonl(path, records, *, trailing_newline=True):
  lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records]
  text = "\n".join(lines) + ("\n" if trailing_newline else "")
  path.write_bytes(text.encode("utf-8"))
  return str(path)


def write_parquet(path, columns, row_group_size=None):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)
  return str(path)


def all_docs(src):
  return [src[i] for i in range(len(src))]


def roundtrip_pickle(src):
  src[0]  # open files first: pickling must drop the open handles
  return pickle.loads(pickle.dumps(src))


# --- paths --------------------------------------------------------------------------------------


def test_resolve_paths_globs_are_sorted_and_lists_keep_order(tmp_path):
  for name in ["b.txt", "a.txt", "sub/c.txt", "sub/deep/d.txt"]:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(name)
  got = sources.resolve_paths(str(tmp_path / "**" / "*.txt"), "text_files")
  assert got == sorted(got) and len(got) == 4
  # Order of the list is kept; a file named again is kept once, where first named.
  got = sources.resolve_paths([tmp_path / "b.txt", str(tmp_path / "*.txt")], "text_files")
  assert [os.path.basename(p) for p in got] == ["b.txt", "a.txt"]
  assert all(os.path.isabs(p) for p in got)


def test_resolve_paths_no_match(tmp_path):
  pattern = str(tmp_path / "nope-*.jsonl")
  with pytest.raises(DataError, match=re.escape(f"data.train_files: no files match '{pattern}' "
                                                f"(cwd: {os.getcwd()}); check the path or quote "
                                                f"the glob")):
    sources.resolve_paths(pattern, "train_files")
  with pytest.raises(DataError, match="no files match"):
    sources.resolve_paths([str(tmp_path / "missing.txt")], "x")
  with pytest.raises(DataError, match="is a directory"):
    sources.resolve_paths(str(tmp_path), "x")
  with pytest.raises(DataError, match="no paths given"):
    sources.resolve_paths([], "x")


def test_check_mixture_weights():
  assert sources.check_mixture_weights({"a": 3, "b": 1.0}) == {"a": 0.75, "b": 0.25}
  with pytest.raises(DataError, match="weight of source 'web' is 0"):
    sources.check_mixture_weights({"code": 1.0, "web": 0})
  with pytest.raises(DataError, match="weight of source 'code' is -0.5"):
    sources.check_mixture_weights({"code": -0.5})
  with pytest.raises(DataError, match="weight of source 'x' is nan"):
    sources.check_mixture_weights({"x": float("nan")})
  with pytest.raises(DataError, match="no sources"):
    sources.check_mixture_weights({})


# --- text files ---------------------------------------------------------------------------------


def test_text_roundtrip_multi_file_order_and_pickle(tmp_path):
  for i, doc in enumerate(DOCS):
    (tmp_path / f"doc{i}.txt").write_text(doc, encoding="utf-8")
  src = sources.TextFileSource(str(tmp_path / "doc*.txt"))
  assert len(src) == len(DOCS)
  assert all_docs(src) == DOCS
  assert src[-1] == DOCS[-1]
  assert all_docs(roundtrip_pickle(src)) == DOCS
  assert src.describe() == f"text: {len(DOCS)} files, {len(DOCS)} documents"
  with pytest.raises(IndexError):
    src[len(DOCS)]


def test_text_invalid_utf8_fail_vs_replace(tmp_path):
  path = tmp_path / "bad.txt"
  path.write_bytes(b"caf\xc3\xa9 ok \xff\xfe rest")
  with pytest.raises(DataError, match=re.escape(f"{path}: invalid UTF-8 at byte offset 9")):
    sources.TextFileSource(str(path))[0]
  replaced = sources.TextFileSource(str(path), on_decode_error="replace")[0]
  assert replaced == "café ok \ufffd\ufffd rest"
  with pytest.raises(DataError, match="on_decode_error='ignore'"):
    sources.TextFileSource(str(path), on_decode_error="ignore")


# --- JSONL --------------------------------------------------------------------------------------


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_jsonl_index_blank_lines_and_last_line(tmp_path, trailing_newline):
  lines = ["", json.dumps({"text": DOCS[0]}), "   ", "\t\r",
           json.dumps({"text": DOCS[1], "id": 7}, ensure_ascii=False), "", "",
           json.dumps({"text": DOCS[2]}, ensure_ascii=False) + "\r",  # CRLF line
           json.dumps({"text": DOCS[3]}), json.dumps({"text": DOCS[4]})]
  path = write_jsonl(tmp_path / "a.jsonl", lines, trailing_newline=trailing_newline)
  src = sources.JsonlSource(path)
  assert all_docs(src) == DOCS
  raw = open(path, "rb").read()
  expected = [raw.index(lines[i].encode()) for i in [1, 4, 7, 8, 9]]
  np.testing.assert_array_equal(sources.nonblank_line_starts(path), expected)
  # Small chunks put chunk edges inside lines, at newlines and inside blank runs.
  for chunk in [1, 2, 3, 7, 64]:
    np.testing.assert_array_equal(sources.nonblank_line_starts(path, chunk), expected)


def test_jsonl_index_edge_files(tmp_path):
  (tmp_path / "one.jsonl").write_bytes(b'{"text": "x"}')
  np.testing.assert_array_equal(sources.nonblank_line_starts(str(tmp_path / "one.jsonl")), [0])
  (tmp_path / "blank.jsonl").write_bytes(b"\n \n\r\n")
  assert len(sources.nonblank_line_starts(str(tmp_path / "blank.jsonl"))) == 0
  (tmp_path / "empty.jsonl").write_bytes(b"")
  assert len(sources.nonblank_line_starts(str(tmp_path / "empty.jsonl"))) == 0


def test_jsonl_multi_file_glob_order_pickle_and_grain(tmp_path):
  (tmp_path / "b.jsonl").write_text(json.dumps({"text": "b0"}) + "\n")
  write_jsonl(tmp_path / "a.jsonl", [{"text": "a0"}, {"text": "a1"}])
  write_jsonl(tmp_path / "c.jsonl", [{"body": "c0", "text": 1}], trailing_newline=False)
  (tmp_path / "empty.jsonl").write_bytes(b"\n\n")  # a file without documents is fine
  src = sources.JsonlSource([str(tmp_path / "[ab]*.jsonl"), str(tmp_path / "empty.jsonl")])
  assert all_docs(src) == ["a0", "a1", "b0"]
  assert all_docs(roundtrip_pickle(src)) == ["a0", "a1", "b0"]
  assert src.describe() == "jsonl: 3 files, 3 documents, field 'text'"
  other = sources.JsonlSource(str(tmp_path / "c.jsonl"), field="body")
  assert all_docs(other) == ["c0"]
  # The source works as grain's random-access source, shuffled.
  ds = grain.MapDataset.source(src).shuffle(seed=0)
  assert sorted(ds[i] for i in range(len(ds))) == ["a0", "a1", "b0"]


@pytest.mark.parametrize("line,message", [
    ('{"text": "ok"', "malformed JSON (Expecting ',' delimiter at column 14)"),
    ('["text"]', "the record is an array, not a JSON object"),
    ('{"body": "x", "id": 1}', "no field 'text' (the record's keys: 'body', 'id'); set "
                               "data.field"),
    ('{"text": 42}', "field 'text' is a number, not a string"),
    ('{"text": null}', "field 'text' is null, not a string"),
])
def test_jsonl_bad_record_fail_names_file_and_line(tmp_path, line, message):
  path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "first"}, "", line, {"text": "last"}])
  src = sources.JsonlSource(path)  # "fail" checks records as they are read
  assert len(src) == 3 and src[0] == "first" and src[2] == "last"
  with pytest.raises(DataError, match=re.escape(f"{path}:3: {message}")):
    src[1]


def test_jsonl_concurrent_reads_and_fork(tmp_path):
  docs = [f"doc {i} " + "x" * (i % 50) for i in range(500)]
  paths = [write_jsonl(tmp_path / f"{k}.jsonl", [{"text": d} for d in docs[k::3]])
           for k in range(3)]
  src = sources.JsonlSource(paths)
  expected = all_docs(src)
  # grain reads with threads; the shared handles must not interleave seek and readline.
  order = np.random.default_rng(0).permutation(len(src)).tolist() * 4
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(src.__getitem__, order))
  assert got == [expected[i] for i in order]
  # After a fork the inherited handles are dropped, not used (they share the parent's offsets).
  src._files._pid = -1  # pylint: disable=protected-access  # as if this process had forked
  assert all_docs(src) == expected


def test_jsonl_invalid_utf8_record(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
  with pytest.raises(DataError, match=re.escape(f"{path}:2: invalid UTF-8 at byte 13 of the line")):
    sources.JsonlSource(str(path))[1]


def test_jsonl_bom_at_file_start(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "x"}).encode() + b"\n")
  assert all_docs(sources.JsonlSource(str(path))) == ["x"]


def test_jsonl_skip_mode_counts_and_excludes(tmp_path):
  path = write_jsonl(tmp_path / "mixed.jsonl", [
      {"text": "a"}, "{broken", "", {"text": 3}, {"other": "x"}, {"text": "b"}, "[1]",
      {"text": "c"}, "nul", "1"])
  src = sources.JsonlSource(path, on_bad_record="skip")
  assert all_docs(src) == ["a", "b", "c"]
  assert src.skipped == 6
  assert len(src.skip_reasons) == 5
  assert src.skip_reasons[0].startswith(f"{path}:2: malformed JSON")
  assert src.skip_reasons[1].startswith(f"{path}:4: field 'text' is a number")
  assert src.skip_reasons[2].startswith(f"{path}:5: no field 'text'")
  assert src.describe() == "jsonl: 1 file, 3 documents, field 'text', 6 skipped"
  assert all_docs(roundtrip_pickle(src)) == ["a", "b", "c"]


def test_jsonl_empty_corpus(tmp_path):
  path = tmp_path / "blank.jsonl"
  path.write_bytes(b"\n  \n")
  with pytest.raises(DataError, match=re.escape(f"data.val_files: empty corpus: jsonl {path} "
                                                f"contains no documents")):
    sources.JsonlSource(str(path), what="val_files")
  bad = write_jsonl(tmp_path / "allbad.jsonl", [{"x": 1}, {"x": 2}])
  with pytest.raises(DataError, match=r"contains no documents \(2 bad records skipped, e.g. .*"
                                      r"allbad.jsonl:1: no field 'text'"):
    sources.JsonlSource(bad, on_bad_record="skip")


def test_jsonl_index_of_many_lines_across_read_chunks(tmp_path):
  """Many identical non-ASCII lines (the benchmark's file, benchmarks/jsonl_index.py, small): the
  index finds every line start, also when its reads end inside lines and multi-byte characters,
  and random reads return the record's text."""
  text = "ein Beispieltext äöü " * 20
  line = (json.dumps({"text": text, "id": 123}, ensure_ascii=False) + "\n").encode()
  reps = 3000
  path = tmp_path / "big.jsonl"
  path.write_bytes(line * reps)
  expected = np.arange(reps, dtype=np.int64) * len(line)
  starts = sources.nonblank_line_starts(str(path))  # 1 MiB reads: the first ends inside a line
  assert len(starts) == reps
  np.testing.assert_array_equal(starts, expected)
  # Reads that end inside lines and characters, and reads that end exactly at line ends.
  for chunk in [1000, 4096, len(line)]:
    np.testing.assert_array_equal(sources.nonblank_line_starts(str(path), chunk), expected)
  src = sources.JsonlSource(str(path))
  assert len(src) == reps
  for i in np.random.default_rng(0).integers(0, reps, 200):
    assert src[i] == text


# --- Parquet ------------------------------------------------------------------------------------


def test_parquet_roundtrip_row_groups_and_cache(tmp_path):
  first = [f"doc {i} ü" for i in range(23)]
  write_parquet(tmp_path / "p0.parquet", {"text": first, "n": list(range(23))}, row_group_size=5)
  write_parquet(tmp_path / "p1.parquet", {"text": DOCS})
  src = sources.ParquetSource(str(tmp_path / "*.parquet"))
  assert len(src) == 23 + len(DOCS)
  expected = first + DOCS
  assert all_docs(src) == expected
  # Out-of-order access across row groups and files.
  order = np.random.default_rng(1).permutation(len(src))
  assert [src[i] for i in order] == [expected[i] for i in order]
  assert all_docs(roundtrip_pickle(src)) == expected
  assert src.describe() == f"parquet: 2 files, {len(expected)} documents, column 'text'"


def test_parquet_missing_column_lists_columns(tmp_path):
  path = write_parquet(tmp_path / "p.parquet", {"content": ["a"], "id": [1]})
  with pytest.raises(DataError, match=re.escape(f"{path}: no column 'text'; available columns: "
                                                f"content, id")):
    sources.ParquetSource(path)
  with pytest.raises(DataError, match="column 'id' has type int64, not string"):
    sources.ParquetSource(path, column="id")
  assert sources.ParquetSource(path, column="content")[0] == "a"


def test_parquet_null_and_empty(tmp_path):
  path = write_parquet(tmp_path / "n.parquet", {"text": ["a", None]})
  src = sources.ParquetSource(path)
  with pytest.raises(DataError, match=re.escape(f"{path}: row 1 of column 'text' is null")):
    src[1]
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  empty = write_parquet(tmp_path / "e.parquet", {"text": pa.array([], pa.string())})
  with pytest.raises(DataError, match="empty corpus: parquet .*e.parquet contains no documents"):
    sources.ParquetSource(empty)


# --- prepared corpora (flat token arrays) -------------------------------------------------------


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
