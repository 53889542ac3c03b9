"""Raw data and prepare's output on object storage, against the S3 server the tests start on the
loopback interface (tests/object_store.py): raw JSONL read from a bucket through the local cache
(data/sources/remote_files.py) gives what the local files give, in prepare and in training
batches; `prepare --output s3://...` publishes a corpus equal to a local one, refuses or replaces
a finished one as a local directory does, and loses nothing when a job fails; the refusals are
one line naming the URL."""

import json
import os
import pickle
from unittest import mock

import pytest

from jaxtrain import storage
from jaxtrain.data import sources
from jaxtrain.data.prepare import main, prepare
from tests.data_helpers import assert_reads_like, make_docs, write_jsonl
from tests.object_store import s3_server, upload


@pytest.fixture(scope="module")
def s3():
  with s3_server() as (_, bucket):
    yield f"s3://{bucket}"


@pytest.fixture(autouse=True)
def staging(tmp_path, monkeypatch):
  """Each test's own staging directory (and so its own download cache)."""
  path = tmp_path / "staging"
  monkeypatch.setenv(storage.STAGING_ENV, str(path))
  return path


def _raw(tmp_path, name="raw"):
  """Three small JSONL files, one in a subdirectory (for `**`); their local directory."""
  root = tmp_path / name
  (root / "sub").mkdir(parents=True)
  write_jsonl(root / "b.jsonl", make_docs(9, seed=1))
  write_jsonl(root / "a.jsonl", make_docs(11, seed=2))
  write_jsonl(root / "sub" / "c.jsonl", make_docs(7, seed=3))
  return root


def _upload_tree(root, url):
  for directory, _, files in os.walk(root):
    rel = os.path.relpath(directory, root)
    if files:
      upload(directory, url if rel == "." else storage.join(url, rel))


def _bucket_files(url):
  """{relative name: bytes} of the objects directly under `url`."""
  return {n: storage.read_bytes(storage.join(url, n)) for n in storage.listdir(url)}


def _one_line(text):
  assert text and "\n" not in text.strip(), text
  return text


def test_prepare_from_a_bucket_to_a_bucket_equals_a_local_prepare(s3, tmp_path, staging):
  root = _raw(tmp_path)
  _upload_tree(root, f"{s3}/raw1")
  # `**` expands on the bucket as Python's recursive glob does locally, sorted alike.
  names = sources.resolve_paths(f"{s3}/raw1/**/*.jsonl", "input")
  local = sources.resolve_paths(str(root / "**" / "*.jsonl"), "input")
  assert [n[len(f"{s3}/raw1/"):] for n in names] == [os.path.relpath(p, root) for p in local]

  lines = []
  args = {"format": "jsonl", "tokenizer": "byte", "num_workers": 1, "docs_per_shard": 8}
  remote = prepare(f"{s3}/raw1/**/*.jsonl", output=f"{s3}/prepared1/", log=lines.append, **args)
  here = prepare(str(root / "**" / "*.jsonl"), output=str(tmp_path / "prepared"), log=None, **args)
  got = _bucket_files(f"{s3}/prepared1")
  want = {n: (tmp_path / "prepared" / n).read_bytes()
          for n in os.listdir(tmp_path / "prepared")}
  assert sorted(got) == sorted(want) and len(want) == 2 * 4 + 1
  for name in want:
    if name == "manifest.json":  # the same but for the input, as named
      got_m, want_m = json.loads(got[name]), json.loads(want[name])
      assert got_m.pop("input") == f"{s3}/raw1/**/*.jsonl" and want_m.pop("input")
      assert got_m == want_m
    else:
      assert got[name] == want[name], name
  assert remote["totals"] == here["totals"]
  assert any(f"shards in {s3}/prepared1" in line for line in lines)
  assert any(line.startswith("uploading 9 files") and line.endswith(f"to {s3}/prepared1")
             for line in lines)
  # The staging copy is gone; the downloaded inputs stay cached, whole, under their URLs' paths.
  assert not os.path.exists(storage.staging_path(f"{s3}/prepared1"))
  cached = sorted(os.path.relpath(os.path.join(d, f), staging)
                  for d, _, files in os.walk(staging) for f in files)
  raw = ("a.jsonl", "b.jsonl", os.path.join("sub", "c.jsonl"))
  assert [c.rsplit("@", 1)[0] for c in cached] == [
      os.path.join("s3", "jaxtrain-test", "raw1", p) for p in raw]
  for copy, p in zip(cached, raw):
    assert (staging / copy).read_bytes() == (root / p).read_bytes()
  # The bucket corpus reads as the local one does.
  assert sources.PreparedCorpus(f"{s3}/prepared1").describe() == sources.PreparedCorpus(
      str(tmp_path / "prepared")).describe()


def test_the_cache_downloads_an_object_once_and_again_when_it_changes(s3, tmp_path):
  root = _raw(tmp_path)
  upload(str(root), f"{s3}/raw2")
  url = f"{s3}/raw2/a.jsonl"
  calls = []
  real = storage.download_files
  with mock.patch.object(storage, "download_files",
                         lambda urls, paths: calls.append(list(urls)) or real(urls, paths)):
    first = sources.JsonlSource(url)
    again = sources.JsonlSource(url)
    assert calls == [[url]] and first.local_paths == again.local_paths
    assert first.paths == [url] and first.describe().startswith("jsonl: 1 file, 11 documents")
    storage.write_bytes(url, b'{"text": "rewritten"}\n')
    changed = sources.JsonlSource(url)
  assert calls == [[url], [url]] and changed.local_paths != first.local_paths
  assert [changed[0]] == ["rewritten"]
  # The old copy stays whole for a reader that still has it; the reader reads it unchanged.
  assert first[0] == json.loads((root / "a.jsonl").read_text().splitlines()[0])["text"]
  # What grain's or prepare's workers get: local paths only, nothing left to download.
  assert all(os.path.isfile(p) for p in pickle.loads(pickle.dumps(changed)).local_paths)


def test_a_bad_record_in_a_bucket_file_is_named_by_its_url(s3, tmp_path):
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "x.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n', encoding="utf-8")
  upload(str(bad), f"{s3}/bad3")
  src = sources.JsonlSource(f"{s3}/bad3/*.jsonl")
  with pytest.raises(sources.DataError, match=f"^{s3}/bad3/x.jsonl:2: field 'text' is a number"):
    src[1]
  skipping = sources.JsonlSource(f"{s3}/bad3/x.jsonl", on_bad_record="skip")
  assert skipping.skip_reasons[0].startswith(f"{s3}/bad3/x.jsonl:2: ")


def test_a_finished_bucket_corpus_is_refused_replaced_and_kept_when_a_job_fails(s3, tmp_path):
  root = _raw(tmp_path)
  out = f"{s3}/prepared4"
  args = {"format": "jsonl", "tokenizer": "byte", "num_workers": 1, "log": None}
  prepare(str(root / "*.jsonl"), output=out, docs_per_shard=5, **args)
  first = _bucket_files(out)
  assert len(first) == 2 * 4 + 1

  with mock.patch("jaxtrain.data.prepare._build") as build:
    with pytest.raises(sources.DataError) as err:
      prepare(str(root / "*.jsonl"), output=out, docs_per_shard=5, **args)
  build.assert_not_called()  # refused before any tokenizing
  assert _one_line(str(err.value)) == (
      f"output {out} already holds a prepared corpus (manifest.json); pass --overwrite "
      f"(overwrite=True) to replace it, or choose another URL")

  # Replaced: the new shards (other names: fewer of them), none of the old left behind.
  lines = []
  prepare(str(root / "*.jsonl"), output=out, docs_per_shard=8, overwrite=True,
          **{**args, "log": lines.append})
  second = _bucket_files(out)
  assert sorted(second) == sorted(["manifest.json"] + [
      f"shard-0000{i}-of-00003{s}" for i in range(3) for s in (".bin", ".idx.npy")])
  assert json.loads(second["manifest.json"])["docs_per_shard"] == 8
  assert f"removed 9 files of an earlier run from {out}" in lines

  # A job that fails (a bad record) leaves the finished corpus as it was, and no staging copy.
  write_jsonl(root / "c.jsonl", make_docs(3))
  with open(root / "c.jsonl", "a", encoding="utf-8") as f:
    f.write('{"title": "no text"}\n')
  with pytest.raises(sources.DataError, match="c.jsonl:4: no field 'text'"):
    prepare(str(root / "*.jsonl"), output=out, docs_per_shard=8, overwrite=True,
            on_bad_record="fail", **args)
  assert _bucket_files(out) == second
  assert not os.path.exists(storage.staging_path(out))


def test_training_batches_from_bucket_files_equal_the_local_ones(s3, tmp_path):
  root = _raw(tmp_path)
  _upload_tree(root, f"{s3}/raw5")
  assert_reads_like(str(root / "**" / "*.jsonl"), f"{s3}/raw5/**/*.jsonl", source="jsonl",
                    batches=6)


@pytest.mark.parametrize("path,message", [
    ("{s3}/nothing/*.jsonl",
     "data.train_paths: no objects match '{s3}/nothing/*.jsonl'; check the URL and the glob"),
    ("{s3}/nothing/a.jsonl",
     "data.train_paths: {s3}/nothing/a.jsonl does not exist (no such object); check the URL"),
    ("s3://no-such-bucket-jaxtrain/*.jsonl",
     "data.train_paths: s3://no-such-bucket-jaxtrain/*.jsonl: the bucket "
     "'no-such-bucket-jaxtrain' does not exist"),
])
def test_raw_paths_on_a_bucket_that_name_nothing_are_one_line(s3, path, message):
  with pytest.raises(sources.DataError) as err:
    sources.JsonlSource(path.format(s3=s3), what="train_paths")
  assert _one_line(str(err.value)).startswith(message.format(s3=s3))


def test_a_prefix_named_as_a_file_asks_for_a_glob(s3, tmp_path):
  upload(str(_raw(tmp_path)), f"{s3}/raw6")
  for given in (f"{s3}/raw6", f"{s3}/raw6/"):
    with pytest.raises(sources.DataError, match=rf"^data.paths: '{given}' is a directory; name "
                                                rf"its files with a glob such as "
                                                rf"'{s3}/raw6/\*.jsonl'$"):
      sources.TextFileSource(given)


@pytest.mark.parametrize("output,input_,words", [
    ("hdfs://cluster/prepared", "{local}", "error: output: 'hdfs://cluster/prepared': the scheme "
     "'hdfs://' is not supported; use a local path, s3://BUCKET/... or gs://BUCKET/..."),
    ("s3://no-such-bucket-jaxtrain/prepared", "{local}", "error: output: "
     "s3://no-such-bucket-jaxtrain/prepared: the bucket 'no-such-bucket-jaxtrain' does not exist"),
    ("{s3}/prepared7", "{s3}/none/*.jsonl", "error: --input: no objects match "
     "'{s3}/none/*.jsonl'"),
])
def test_prepare_cli_refusals_are_one_line_and_write_nothing(s3, tmp_path, staging, capsys,
                                                             output, input_, words):
  local = str(_raw(tmp_path) / "*.jsonl")
  output, input_ = output.format(s3=s3), input_.format(s3=s3, local=local)
  rc = main(["--input", input_, "--format", "jsonl", "--tokenizer", "byte", "--output", output])
  err = capsys.readouterr().err
  assert rc == 2 and _one_line(err).startswith(words.format(s3=s3)), err
  assert not staging.exists()
  if output.startswith(s3):
    assert storage.listdir(output) == []
