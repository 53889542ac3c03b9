"""`python -m jaxtrain.interop.hf import|export` with directories on object storage (s3://, gs://;
jaxtrain/interop/hf_storage.py), against the S3 server the tests start on the loopback interface
(tests/object_store.py): a bucket's import and export write what the same local commands write,
bit for bit, and every refusal is one line that leaves nothing behind."""

import contextlib
import io
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxtrain import config as config_lib
from jaxtrain import storage
from jaxtrain.checkpointing import mirror as checkpoint_mirror, weights as checkpoint_weights
from jaxtrain.config import ConfigError
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.interop import hf, hf_io, hf_storage
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model
from tests.helpers import assert_same_safetensors
from tests.object_store import s3_server, upload

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
# Three safetensors shards with their index, and a tokenizer.json: every file kind an import reads.
GQA = os.path.join(FIXTURES, "hf_llama_gqa_llama3")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
  with pytest.MonkeyPatch.context() as mp, s3_server() as (_, bucket):
    mp.setenv(storage.STAGING_ENV, str(tmp_path_factory.mktemp("staging")))
    yield f"s3://{bucket}"


@pytest.fixture(scope="module")
def imported(s3, tmp_path_factory):
  """(the weights directory imported from the bucket to the bucket, the same imported locally,
  the import's printed lines, the `last` files of each upload)."""
  tmp = tmp_path_factory.mktemp("imported")
  upload(GQA, f"{s3}/hf/gqa")
  # Another copy of the weights, as model repositories ship: not downloaded.
  storage.write_bytes(f"{s3}/hf/gqa/original/consolidated.00.pth", b"\x80\x04")
  local = str(tmp / "weights")
  assert hf.main(["import", f"--hf_dir={GQA}", f"--out={local}", "--dtype=bfloat16"]) == 0
  url, uploads = f"{s3}/weights/gqa", []
  real = storage.upload_dir
  # A module-scoped fixture has no capsys.
  with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as printed:
    mp.setattr(storage, "upload_dir",
               lambda *a, **k: uploads.append(k.get("last")) or real(*a, **k))
    assert hf.main(["import", f"--hf_dir={s3}/hf/gqa/", f"--out={url}", "--dtype=bfloat16"]) == 0
  return url, local, printed.getvalue(), uploads


def _params(directory, config):
  _, abstract_params, _ = abstract_model(ModelConfig.from_config(config), hf_io.default_mesh())
  params, _ = checkpoint_weights.load_params(directory, abstract_params)
  return params


def _assert_same_params(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _read(directory, name):
  with open(os.path.join(directory, name), "rb") as f:
    return f.read()


def _files(directory):
  return sorted(os.path.relpath(os.path.join(root, f), directory)
                for root, _, files in os.walk(directory) for f in files)


def test_import_from_a_bucket_to_a_bucket_writes_the_local_import(imported, s3, tmp_path):
  url, local, printed, uploads = imported
  assert uploads == [("config.py",)]  # config.py last: a directory holding it is whole
  # Only what an import reads came down: not the fixture's extras, nor original/.
  assert sorted(os.listdir(storage.staging_path(f"{s3}/hf/gqa"))) == [
      "config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
      "model-00003-of-00003.safetensors", "model.safetensors.index.json", "tokenizer.json"]
  downloaded = str(tmp_path / "gqa")
  storage.download_dir(url, downloaded)
  # Orbax names its data files at random: params/ is compared by what it restores.
  assert ([n for n in _files(downloaded) if not n.startswith("params")]
          == [n for n in _files(local) if not n.startswith("params")])

  # The written config.py finds the weights and the tokenizer next to it, once downloaded.
  config = config_lib.load_config_file(os.path.join(downloaded, "config.py"))
  want = config_lib.load_config_file(os.path.join(local, "config.py"))
  assert config.checkpoint.init_from == downloaded
  assert config.data.tokenizer == f"hf:{downloaded}/tokenizer.json"
  _assert_same_params(_params(downloaded, config), _params(local, want))
  # Or checkpoint.init_from names the bucket (what the printed values for another config say).
  _assert_same_params(_params(url, config), _params(local, want))
  for c in (config, want):
    c.checkpoint.init_from = c.data.tokenizer = ""
  assert config.to_dict() == want.to_dict()
  assert _read(downloaded, "tokenizer.json") == _read(local, "tokenizer.json")

  # The values for another config file name the bucket, and read from it.
  with open(os.path.join(downloaded, "jaxtrain_config.json"), encoding="utf-8") as f:
    saved = json.load(f)
  with open(os.path.join(local, "jaxtrain_config.json"), encoding="utf-8") as f:
    local_saved = json.load(f)
  assert saved["source"] == f"{s3}/hf/gqa"
  assert saved["overrides"]["checkpoint.init_from"] == url
  assert saved["overrides"]["data.tokenizer"] == f"hf:{url}/tokenizer.json"
  drop = ("checkpoint.init_from", "data.tokenizer")
  assert ({k: v for k, v in saved["overrides"].items() if k not in drop}
          == {k: v for k, v in local_saved["overrides"].items() if k not in drop})
  assert f"aws s3 cp --recursive {url} gqa\n" in printed
  assert "--config=gqa/config.py" in printed
  assert f"--config.data.tokenizer=hf:{url}/tokenizer.json" in printed
  assert f"--config.checkpoint.init_from={url}" in printed
  with open(os.path.join(downloaded, "config.py"), encoding="utf-8") as f:
    assert f"--config.checkpoint.init_from={url}" in f.read()
  texts = ["Hello, world", "ünïcode and <|begin_of_text|> specials"]
  local_tok = load_tokenizer(f"hf:{local}/tokenizer.json")
  for spec in (f"hf:{url}/tokenizer.json", f"hf:{url}", f"{url}/tokenizer.json"):
    tok = load_tokenizer(spec)
    assert tok.name == f"hf:{url}/tokenizer.json"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (local_tok.vocab_size, local_tok.bos_id,
                                                        local_tok.eos_id)
    for text in texts:
      np.testing.assert_array_equal(tok.encode(text), local_tok.encode(text))


def test_export_from_a_bucket_to_a_bucket_writes_the_local_export(imported, s3, tmp_path):
  url, local, _, _ = imported
  local_out = str(tmp_path / "local_hf")
  assert hf.main(["export", f"--checkpoint={local}", f"--out={local_out}",
                  "--max_shard_size=60KB"]) == 0
  out = f"{s3}/exported/gqa"
  assert hf.main(["export", f"--checkpoint={url}", f"--out={out}",
                  "--max_shard_size=60KB"]) == 0
  downloaded = str(tmp_path / "hf")
  storage.download_dir(out, downloaded)
  assert _files(downloaded) == _files(local_out)
  assert len([n for n in _files(downloaded) if n.endswith(".safetensors")]) > 1
  for name in _files(local_out):
    assert _read(downloaded, name) == _read(local_out, name), name

  # --overwrite replaces what is there: no shard of the earlier export stays behind its index.
  assert hf.main(["export", f"--checkpoint={url}", f"--out={out}", "--overwrite"]) == 0
  assert not any(n.startswith("model-") for n in storage.listdir(out))
  assert "model.safetensors" in storage.listdir(out)


def test_export_of_a_run_on_a_bucket_reads_its_newest_complete_step(imported, s3, tmp_path):
  """A run's workdir: step 5 complete (the marker), step 7 still uploading (no marker, its state
  unreadable); TensorBoard events beside them are not downloaded."""
  _, local, _, _ = imported
  config = config_lib.load_config_file(os.path.join(local, "config.py"))
  run = tmp_path / "run"
  step = run / "checkpoints" / "5"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(str(step / "state"), {"params": _params(local, config), "step": np.int32(5)})
    ckptr.wait_until_finished()
  (step / "meta").mkdir()
  (step / "meta" / "metadata").write_text(json.dumps({"config": config.to_dict()}))
  (step / checkpoint_mirror.COMMIT_MARKER).write_text("")
  (run / "checkpoints" / "7" / "state").mkdir(parents=True)
  (run / "checkpoints" / "7" / "state" / "partial").write_text("not orbax")
  (run / "tensorboard").mkdir()
  (run / "tensorboard" / "events.out").write_text("events")
  storage.upload_dir(str(run), f"{s3}/runs/ft")

  out = str(tmp_path / "hf")
  assert hf.main(["export", f"--checkpoint={s3}/runs/ft", f"--out={out}"]) == 0
  want = str(tmp_path / "want")
  assert hf.main(["export", f"--checkpoint={local}", f"--out={want}"]) == 0
  assert_same_safetensors(out, want)
  staged = storage.staging_path(f"s3://{hf_storage.EXPORT_AREA}/{s3[5:]}/runs/ft")
  assert os.listdir(staged) == ["checkpoints"]
  assert os.listdir(os.path.join(staged, "checkpoints")) == ["5"]
  # The run's own staging directory (where a run on this host stages its steps) is untouched.
  assert not os.path.exists(storage.staging_path(f"{s3}/runs/ft"))

  # Steps copied from local disk have no marker: the newest with state/ is read.
  for n in (3, 4):
    storage.write_bytes(f"{s3}/copied/{n}/state/x", b"")
  storage.write_bytes(f"{s3}/copied/9/meta/x", b"")
  assert checkpoint_mirror.newest_step(f"{s3}/copied") == ("4", False)


@pytest.mark.parametrize("argv,message,untouched", [
    (["import", "--hf_dir=s3://no-such-bucket/hf", "--out=S3/fresh"],
     "--hf_dir: s3://no-such-bucket/hf: the bucket 'no-such-bucket' does not exist", "S3/fresh"),
    (["import", "--hf_dir=S3/hf/gqa", "--out=s3://no-such-bucket/w"],
     "--out: s3://no-such-bucket/w: the bucket 'no-such-bucket' does not exist", None),
    (["import", "--hf_dir=hdfs://cluster/hf", "--out=S3/fresh"],
     "--hf_dir: 'hdfs://cluster/hf': the scheme 'hdfs://' is not supported", "S3/fresh"),
    (["import", "--hf_dir=S3/hf/gqa", "--out=ftp://host/w"],
     "--out: 'ftp://host/w': the scheme 'ftp://' is not supported", None),
    (["import", "--hf_dir=S3/nothing", "--out=S3/fresh"],
     "--hf_dir=S3/nothing: nothing there; expected a Hugging Face model directory", "S3/fresh"),
    (["import", "--hf_dir=S3/pickles", "--out=S3/fresh"],
     "--hf_dir=S3/pickles: weights are pickle files (pytorch_model.bin); convert to "
     "safetensors first", "S3/fresh"),
    (["import", "--hf_dir=S3/configonly", "--out=S3/fresh"],  # said of the URL, not staging
     "error: S3/configonly: no model.safetensors; expected model.safetensors", "S3/fresh"),
    (["import", "--hf_dir=S3/hf/gqa", "--out=S3/weights/gqa"],
     "--out=S3/weights/gqa: already holds params/; choose an empty directory", None),
    (["export", "--checkpoint=S3/nothing", "--out=S3/fresh"],
     "--checkpoint=S3/nothing: nothing to export: holds neither params/", "S3/fresh"),
    (["export", "--checkpoint=S3/hf/gqa", "--out=S3/fresh"],
     "--checkpoint=S3/hf/gqa: nothing to export", "S3/fresh"),
    (["export", "--checkpoint=s3://no-such-bucket/run", "--out=S3/fresh"],
     "--checkpoint: s3://no-such-bucket/run: the bucket 'no-such-bucket' does not exist",
     "S3/fresh"),
    (["export", "--checkpoint=S3/weights/gqa", "--out=S3/hf/gqa"],
     "--out=S3/hf/gqa: already holds config.json, model-00001-of-00003.safetensors, "
     "model-00002-of-00003.safetensors; choose an empty directory, or replace them with "
     "--overwrite", None),
    (["export", "--checkpoint=S3/weights/gqa", "--config=S3/weights/gqa/config.py",
      "--out=S3/fresh"], "--config=S3/weights/gqa/config.py: a config file is read from local "
     "disk", "S3/fresh"),
])
def test_refusals_are_one_line_and_write_nothing(imported, s3, capsys, argv, message, untouched):
  storage.write_bytes(f"{s3}/pickles/config.json", b"{}")
  storage.write_bytes(f"{s3}/pickles/pytorch_model.bin", b"\x80\x04")
  storage.write_bytes(f"{s3}/configonly/config.json", _read(GQA, "config.json"))
  before = {p: storage.listdir(p) for p in (f"{s3}/hf/gqa", f"{s3}/weights/gqa")}
  argv = [a.replace("S3/", f"{s3}/") for a in argv]
  assert hf.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  assert message.replace("S3/", f"{s3}/") in err, err
  if untouched:
    assert storage.listdir(untouched.replace("S3/", f"{s3}/")) == []
  assert {p: storage.listdir(p) for p in before} == before


@pytest.mark.parametrize("spec,message", [
    ("hf:S3/none", "tokenizer hf:S3/none/tokenizer.json: S3/none/tokenizer.json does not exist"),
    ("hf:hdfs://cluster/tok.json", "the scheme 'hdfs://' is not supported"),
])
def test_a_tokenizer_url_that_cannot_be_read_is_one_line(s3, spec, message):
  with pytest.raises(ConfigError) as err:
    load_tokenizer(spec.replace("S3/", f"{s3}/"))
  assert "\n" not in str(err.value) and message.replace("S3/", f"{s3}/") in str(err.value)
