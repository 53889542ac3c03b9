"""Tests for the text document sources (text files, JSONL, Parquet); no devices. Prepared token
arrays: test_sources_prepared.py."""

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
from tests.data_helpers import all_docs

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
