"""Tests for `python -m jaxtrain.data.prepare`: shards, manifest, determinism, CLI; no devices."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.data import prepare as prep
from jaxtrain.data import prepare_workers as workers
from jaxtrain.data.sources import DataError, PreparedCorpus, write_token_shard
from jaxtrain.data.tokenizer import load_tokenizer
from tests.data_helpers import make_docs, train_bpe, write_jsonl
from tests.helpers import run_entry

NUM_DOCS = 300
LAST_LINE_RE = re.compile(
    r"prepare: documents=(\d+) tokens=(\d+) shards=(\d+) tokens_per_sec=(\d+)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shard_bytes(directory):
  directory = pathlib.Path(directory)
  return {p.name: p.read_bytes() for p in sorted(directory.glob("shard-*"))}


def run_cli(*args, cwd):
  """`python -m jaxtrain.data.prepare ARGS` in a process of its own: its `__main__` runs the
  importable module's `main`, so that the worker processes can unpickle their function."""
  return subprocess.run([sys.executable, "-m", "jaxtrain.data.prepare", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join(
                            filter(None, [REPO, os.environ.get("PYTHONPATH")]))})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  docs = make_docs(NUM_DOCS)
  jsonl = write_jsonl(root / "docs.jsonl", docs)
  tokenizer_json = train_bpe(str(root / "tok"), docs)
  return {"root": root, "docs": docs, "jsonl": jsonl, "tokenizer": "hf:" + tokenizer_json}


@pytest.fixture(scope="module")
def two_workers(corpus):
  """The BPE corpus prepared by 2 worker processes, 100 documents per shard."""
  out = str(corpus["root"] / "out2")
  manifest = prep.prepare(corpus["jsonl"], format="jsonl", tokenizer=corpus["tokenizer"],
                          output=out, add_bos=True, add_eos=True, num_workers=2,
                          docs_per_shard=100, log=None)
  return out, manifest


def test_shards_and_manifest(corpus, two_workers):
  out, manifest = two_workers
  tok = load_tokenizer(corpus["tokenizer"])
  assert manifest == prep.read_manifest(out)
  assert manifest["version"] == 2 and manifest["token_dtype"] == "<u2"  # vocab 300 fits uint16
  assert manifest["tokenizer"] == corpus["tokenizer"] and manifest["tokenizer_name"] == tok.name
  assert (manifest["vocab_size"], manifest["bos_id"], manifest["eos_id"]) == (
      tok.vocab_size, tok.bos_id, tok.eos_id)
  assert manifest["add_bos"] and manifest["add_eos"]
  assert (manifest["format"], manifest["field"]) == ("jsonl", "text")
  assert manifest["skipped_records"] == 0
  assert [s["file"] for s in manifest["shards"]] == [f"shard-{i:05d}-of-00003" for i in range(3)]
  assert [s["documents"] for s in manifest["shards"]] == [100, 100, 100]
  totals = manifest["totals"]
  assert totals == {"documents": NUM_DOCS, "shards": 3,
                    "tokens": sum(s["tokens"] for s in manifest["shards"])}

  assert sorted(os.listdir(out)) == sorted(
      ["manifest.json"] + [f"shard-{i:05d}-of-00003{ext}" for i in range(3)
                           for ext in (".bin", ".idx.npy")])
  for shard in manifest["shards"]:
    # The raw format: uint16 tokens back to back, and int64 offsets from 0 to the token count.
    prefix = os.path.join(out, shard["file"])
    starts = np.load(prefix + ".idx.npy")
    assert starts.dtype == np.int64 and starts.shape == (shard["documents"] + 1,)
    assert starts[0] == 0 and starts[-1] == shard["tokens"]
    assert os.path.getsize(prefix + ".bin") == 2 * shard["tokens"]

  source = PreparedCorpus(out)
  assert len(source) == NUM_DOCS and source.num_tokens() == totals["tokens"]
  assert source.vocab_size == tok.vocab_size and source.manifest == manifest
  for i, text in enumerate(corpus["docs"]):
    ids = source[i]
    assert ids.dtype == np.int32
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == text
  assert sum(len(source[i]) for i in range(len(source))) == totals["tokens"]
  assert source.describe() == (f"prepared: 3 shards, 300 documents, {totals['tokens']:,} tokens "
                               f"(tokenizer {corpus['tokenizer']})")


def test_output_does_not_depend_on_num_workers(corpus, two_workers):
  out2, manifest2 = two_workers
  out1 = str(corpus["root"] / "out1")
  manifest1 = prep.prepare(corpus["jsonl"], format="jsonl", tokenizer=corpus["tokenizer"],
                           output=out1, add_bos=True, add_eos=True, num_workers=1,
                           docs_per_shard=100, log=None)
  assert manifest1 == manifest2
  a, b = shard_bytes(out1), shard_bytes(out2)
  assert len(a) == 6  # 3 shards, each a .bin and an .idx.npy
  assert a == b  # byte-identical, whichever process wrote which shard


def test_refuses_to_overwrite_and_overwrite_replaces_stale_shards(corpus, tmp_path):
  out = tmp_path / "out"
  kwargs = dict(format="jsonl", tokenizer="byte", output=str(out), num_workers=1, log=None)
  prep.prepare(corpus["jsonl"], docs_per_shard=100, **kwargs)
  before = shard_bytes(out)
  with pytest.raises(DataError, match="already holds a prepared corpus.*overwrite"):
    prep.prepare(corpus["jsonl"], docs_per_shard=50, **kwargs)
  assert shard_bytes(out) == before  # refused before touching anything

  # Files of an older run in the version-1 format (ArrayRecord) go too; other files stay.
  old = ["shard-00000-of-00002.arrayrecord", "shard-00000-of-00002.arrayrecord.lengths.npy",
         "shard-00001-of-00004.bin.tmp-123"]
  for name in old + ["notes.txt", "shard-00000-of-00002.arrayrecord.bak"]:
    (out / name).write_bytes(b"x")
  manifest = prep.prepare(corpus["jsonl"], docs_per_shard=50, overwrite=True, **kwargs)
  assert manifest["totals"]["shards"] == 6
  # The 3-shard run's files are gone, so the directory holds only this run's shards.
  assert sorted(os.listdir(out)) == sorted(
      ["manifest.json", "notes.txt", "shard-00000-of-00002.arrayrecord.bak"]
      + [f"shard-{i:05d}-of-00006{ext}" for i in range(6) for ext in (".bin", ".idx.npy")])
  assert len(PreparedCorpus(out)) == NUM_DOCS


def test_cli(corpus, tmp_path):
  """`python -m jaxtrain.data.prepare` with 2 workers, as a process of its own (run_cli
  above): its workers must find their function in the module, not in `__main__`."""
  out = tmp_path / "cli_out"
  result = run_cli("--input", corpus["jsonl"], "--format", "jsonl", "--field", "text",
                   "--tokenizer", corpus["tokenizer"], "--output", str(out), "--num_workers", "2",
                   "--docs_per_shard", "120", "--no_add_eos", cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().splitlines()
  assert sum(line.startswith("shard ") for line in lines) == 3
  assert re.fullmatch(r"shard 3/3: 60 docs, \S+ tokens", lines[-3])
  m = LAST_LINE_RE.fullmatch(lines[-1])
  assert m, lines[-1]
  manifest = prep.read_manifest(out)
  assert not manifest["add_eos"] and not manifest["add_bos"]
  assert [int(g) for g in m.groups()[:3]] == [
      NUM_DOCS, manifest["totals"]["tokens"], manifest["totals"]["shards"]]
  assert int(m.group(4)) > 0


def test_cli_glob_matching_nothing(tmp_path):
  # In this process: the exit code is main's, and nothing starts workers.
  result = run_entry(prep.main, "--input", str(tmp_path / "nothing-*.jsonl"), "--format",
                     "jsonl", "--tokenizer", "byte", "--output", str(tmp_path / "out"),
                     cwd=tmp_path)
  assert result.returncode == 2
  assert result.stdout == ""
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert result.stderr.startswith("error: --input: no files match") and "Traceback" not in (
      result.stderr)
  assert not (tmp_path / "out").exists()


def test_byte_tokenizer_on_text_files(tmp_path):
  docs = ["plain ascii", "zweite Zeile: äöü ß\n", "日本語のテキスト 🚀", "", "x" * 1000]
  for i, d in enumerate(docs):
    (tmp_path / "in" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
    (tmp_path / "in" / f"{i:02d}.txt").write_text(d, encoding="utf-8")
  out = tmp_path / "out"
  manifest = prep.prepare(str(tmp_path / "in" / "*.txt"), format="text", tokenizer="byte",
                          output=str(out), num_workers=1, docs_per_shard=2, log=None)
  assert manifest["field"] is None and manifest["totals"]["shards"] == 3
  assert manifest["token_dtype"] == "<u2"  # byte ids 0..257
  tok = load_tokenizer("byte")
  source = PreparedCorpus(out / "manifest.json")  # the manifest names the corpus too
  assert [tok.decode(source[i]) for i in range(len(source))] == docs
  assert all(source[i][-1] == tok.eos_id for i in range(len(source)))
  lengths = [len(d.encode("utf-8")) + 1 for d in docs]
  assert manifest["totals"]["tokens"] == sum(lengths)
  assert source.doc_lengths().tolist() == lengths  # the indexes match the documents


def test_bad_records_fail_or_skip(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"text": "good one"}\n{"text": 3}\nnot json\n{"text": "good two"}\n',
                  encoding="utf-8")
  kwargs = dict(format="jsonl", tokenizer="byte", num_workers=1, log=None)
  with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'text' is a number"):
    prep.prepare(str(path), output=str(tmp_path / "fail"), **kwargs)
  assert not os.path.exists(tmp_path / "fail" / "manifest.json")  # a failed run is incomplete
  manifest = prep.prepare(str(path), output=str(tmp_path / "skip"), on_bad_record="skip", **kwargs)
  assert manifest["skipped_records"] == 2 and manifest["totals"]["documents"] == 2

  # Text files are read by the workers: an invalid UTF-8 file is skipped there.
  (tmp_path / "t").mkdir()
  (tmp_path / "t" / "a.txt").write_text("fine", encoding="utf-8")
  (tmp_path / "t" / "b.txt").write_bytes(b"\xff\xfe broken")
  manifest = prep.prepare(str(tmp_path / "t" / "*.txt"), format="text", tokenizer="byte",
                          output=str(tmp_path / "tskip"), on_bad_record="skip", num_workers=1,
                          log=None)
  assert manifest["skipped_records"] == 1 and manifest["totals"]["documents"] == 1


def test_batches_match_per_document_encoding(corpus, tmp_path, monkeypatch):
  """Shards hold exactly encode_document's ids, whether a batch ends by count or by characters."""
  tok = load_tokenizer(corpus["tokenizer"])
  calls = []
  batch_encode = type(tok).encode_documents

  def recording(self, texts, **kwargs):
    calls.append([len(t) for t in texts])
    return batch_encode(self, texts, **kwargs)

  monkeypatch.setattr(type(tok), "encode_documents", recording)
  monkeypatch.setattr(workers, "_BATCH_DOCS", 7)
  monkeypatch.setattr(workers, "_BATCH_CHARS", 1000)
  out = tmp_path / "out"
  prep.prepare(corpus["jsonl"], format="jsonl", tokenizer=tok, output=str(out), add_bos=True,
               add_eos=True, num_workers=1, docs_per_shard=100, log=None)
  source = PreparedCorpus(out)
  for i, text in enumerate(corpus["docs"]):
    np.testing.assert_array_equal(source[i], tok.encode_document(text, add_bos=True, add_eos=True))
  # Batches never span shards, hold at most 7 documents, and end once they reach 1000 characters;
  # both limits were hit.
  assert sum(map(len, calls)) == NUM_DOCS and max(map(len, calls)) == 7
  assert all(sum(lengths[:-1]) < 1000 for lengths in calls)
  assert any(len(lengths) < 7 and sum(lengths) >= 1000 for lengths in calls)
  ends = np.cumsum([len(lengths) for lengths in calls])
  assert {100, 200} <= set(ends.tolist())


def test_batches_skip_or_fail_bad_records_in_order(tmp_path, monkeypatch):
  """Bad records inside and at the edges of batches: skipped and counted in order, or the run
  fails at the first one, as with one document at a time."""
  monkeypatch.setattr(workers, "_BATCH_DOCS", 2)
  texts = {f"{i:02d}.txt": f"document {i} é" for i in range(9)}
  bad = ["00.txt", "03.txt", "04.txt", "08.txt"]  # first, a pair across a batch edge, last
  (tmp_path / "in").mkdir()
  for name, text in texts.items():
    data = b"\xff\xfe broken" if name in bad else text.encode("utf-8")
    (tmp_path / "in" / name).write_bytes(data)
  pattern = str(tmp_path / "in" / "*.txt")
  lines = []
  manifest = prep.prepare(pattern, format="text", tokenizer="byte", output=str(tmp_path / "skip"),
                          on_bad_record="skip", num_workers=1, docs_per_shard=5, log=lines.append)
  assert manifest["skipped_records"] == 4
  assert [s["documents"] for s in manifest["shards"]] == [2, 3]
  source = PreparedCorpus(tmp_path / "skip")
  tok = load_tokenizer("byte")
  good = [text for name, text in texts.items() if name not in bad]
  assert [tok.decode(source[i]) for i in range(len(source))] == good
  reasons = [line for line in lines if "invalid UTF-8" in line]
  assert [os.path.basename(r.split(":")[0].strip()) for r in reasons] == bad

  good_then_bad = str(tmp_path / "in" / "0[1-3].txt")  # 01, 02 fill a batch; 03 starts the next
  with pytest.raises(DataError, match=r"03\.txt: invalid UTF-8 at byte offset 0"):
    prep.prepare(good_then_bad, format="text", tokenizer="byte", output=str(tmp_path / "fail"),
                 num_workers=1, log=None)
  assert not os.path.exists(tmp_path / "fail" / "manifest.json")
  assert not [n for n in os.listdir(tmp_path / "fail") if ".tmp-" in n]


def test_worker_plan(corpus, monkeypatch):
  """Processes x tokenizer threads: a process per CPU by default, one for a small input; HF's
  threads share out the CPUs among the processes."""
  monkeypatch.setattr(workers, "_available_cpus", lambda: 8)
  for var in ("RAYON_NUM_THREADS", "TOKENIZERS_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
    monkeypatch.delenv(var, raising=False)
  byte, hf = load_tokenizer("byte"), load_tokenizer(corpus["tokenizer"])
  big, small = workers.SMALL_INPUT_BYTES, workers.SMALL_INPUT_BYTES - 1

  def plan(tok, num_workers, num_shards, input_bytes=big):
    return prep.worker_plan(tok, num_workers, num_shards, input_bytes)

  assert [plan(byte, None, 100), plan(byte, None, 3), plan(byte, 2, 100)] == [
      (8, 1), (3, 1), (2, 1)]
  assert [plan(hf, None, 100), plan(hf, None, 2), plan(hf, None, 1)] == [(8, 1), (2, 4), (1, 8)]
  assert [plan(hf, 1, 100), plan(hf, 2, 100), plan(hf, 3, 100), plan(hf, 4, 2),
          plan(hf, 16, 100)] == [(1, 8), (2, 4), (3, 2), (2, 4), (16, 1)]
  # A small input runs in-process unless workers are asked for.
  assert [plan(byte, None, 100, small), plan(hf, None, 100, small)] == [(1, 1), (1, 8)]
  assert [plan(byte, 2, 100, small), plan(hf, 2, 100, small)] == [(2, 1), (2, 4)]
  monkeypatch.setenv("RAYON_NUM_THREADS", "3")  # the user's choice wins
  assert [plan(hf, 2, 100), plan(byte, 2, 100)] == [(2, 3), (2, 1)]
  monkeypatch.delenv("RAYON_NUM_THREADS")
  monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # HF then encodes on one thread
  assert [plan(hf, None, 1), plan(hf, 2, 100)] == [(1, 1), (2, 1)]


def test_default_prepares_a_small_input_in_process(corpus, tmp_path, monkeypatch):
  monkeypatch.setattr(workers, "_available_cpus", lambda: 4)
  for var in ("RAYON_NUM_THREADS", "TOKENIZERS_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
    monkeypatch.delenv(var, raising=False)
  lines = []
  prep.prepare(corpus["jsonl"], format="jsonl", tokenizer=corpus["tokenizer"],
               output=str(tmp_path / "out"), docs_per_shard=100, log=lines.append)
  assert "-> 3 shards in " in lines[0] and ", 1 workers (4 tokenizer threads each), " in lines[0]


def test_worker_process_caps_tokenizer_threads(corpus, monkeypatch):
  """A worker process exports its share of threads before its first batch; the user's wins."""
  environ = {k: v for k, v in os.environ.items()
             if k not in ("RAYON_NUM_THREADS", "TOKENIZERS_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
  monkeypatch.setattr(os, "environ", environ)  # a copy: nothing leaks into this process
  monkeypatch.setattr(workers, "_state", {})
  hf = load_tokenizer(corpus["tokenizer"])
  args = (None, hf, False, True, False, "unused", 100, 1, "<u2")
  workers._init_worker(*args, 3)
  assert (environ["RAYON_NUM_THREADS"], environ["TOKENIZERS_NUM_THREADS"]) == ("3", "3")
  environ["RAYON_NUM_THREADS"] = environ["TOKENIZERS_NUM_THREADS"] = "5"
  workers._init_worker(*args, 2)
  assert (environ["RAYON_NUM_THREADS"], environ["TOKENIZERS_NUM_THREADS"]) == ("5", "5")
  del environ["RAYON_NUM_THREADS"], environ["TOKENIZERS_NUM_THREADS"]
  workers._init_worker(*args)  # in-process: the caller's environment is left alone
  workers._init_worker(None, load_tokenizer("byte"), *args[2:], 1)  # no threads to cap
  assert "RAYON_NUM_THREADS" not in environ and "TOKENIZERS_NUM_THREADS" not in environ


def test_empty_input_and_bad_arguments(tmp_path):
  blank = tmp_path / "blank.jsonl"
  blank.write_text("\n  \n", encoding="utf-8")
  with pytest.raises(DataError, match="empty corpus"):
    prep.prepare(str(blank), format="jsonl", tokenizer="byte", output=str(tmp_path / "o"),
                 log=None)
  with pytest.raises(ConfigError, match="format='csv'"):
    prep.prepare(str(blank), format="csv", tokenizer="byte", output=str(tmp_path / "o"))
  with pytest.raises(ConfigError, match="num_workers=0"):
    prep.prepare(str(blank), format="jsonl", tokenizer="byte", output=str(tmp_path / "o"),
                 num_workers=0)


def test_read_manifest_errors(corpus, tmp_path):
  with pytest.raises(DataError, match=r"no manifest\.json.*jaxtrain\.data\.prepare"):
    prep.read_manifest(tmp_path)
  out = tmp_path / "out"
  prep.prepare(corpus["jsonl"], format="jsonl", tokenizer="byte", output=str(out),
               num_workers=1, docs_per_shard=100, log=None)
  os.remove(out / "shard-00001-of-00003.idx.npy")
  with pytest.raises(DataError, match=r"shard-00001-of-00003\.idx\.npy is missing"):
    prep.read_manifest(out)

  # A corpus prepared by the ArrayRecord version: one line with the command that re-prepares it.
  old = tmp_path / "old"
  old.mkdir()
  (old / "shard-00000-of-00001.arrayrecord").write_bytes(b"records")
  (old / "manifest.json").write_text(json.dumps({
      "version": 1, "tokenizer": "hf:/tok/tokenizer.json", "input": "data/*.jsonl",
      "format": "jsonl", "field": "body", "add_bos": False, "add_eos": True,
      "shards": [{"file": "shard-00000-of-00001.arrayrecord", "documents": 3, "tokens": 9}]}))
  with pytest.raises(DataError) as e:
    prep.read_manifest(old)
  message = str(e.value)
  assert "\n" not in message and "old ArrayRecord format" in message
  assert message.endswith("python -m jaxtrain.data.prepare --input 'data/*.jsonl' --format jsonl "
                          "--field body --tokenizer hf:/tok/tokenizer.json --output NEW_DIR")


def test_uint32_tokens_for_a_large_vocab(tmp_path):
  """Vocabularies past 65536 ids are stored as uint32 and read back exactly."""
  from jaxtrain.data.sources import token_dtype  # pylint: disable=import-outside-toplevel
  assert [token_dtype(v) for v in (258, 65536, 65537, 128_256)] == ["<u2", "<u2", "<u4", "<u4"]
  with pytest.raises(DataError, match="vocab_size=2147483649: ids above 2147483647"):
    token_dtype(2**31 + 1)  # read back as int32, such ids would wrap
  docs = [np.array([0, 65535, 65536, 128_255, 2**32 - 1], np.int64), np.array([], np.int64),
          np.array([70_000] * 3, np.int32)]
  prefix = str(tmp_path / "shard-00000-of-00001")
  assert write_token_shard(prefix, docs, "<u4") == (3, 8)
  assert os.path.getsize(prefix + ".bin") == 8 * 4
  np.testing.assert_array_equal(np.fromfile(prefix + ".bin", "<u4"), np.concatenate(docs))
  np.testing.assert_array_equal(np.load(prefix + ".idx.npy"), [0, 5, 5, 8])
  # The same ids do not fit uint16: refused, naming the ids and the dtype, and no file is left.
  with pytest.raises(DataError, match=r"token ids in \[0, 4294967295\], outside \[0, 65535\] of "
                                      r"uint16 \(<u2\)"):
    write_token_shard(str(tmp_path / "small"), docs, "<u2")
  assert sorted(os.listdir(tmp_path)) == ["shard-00000-of-00001.bin",
                                          "shard-00000-of-00001.idx.npy"]
