"""Weights & Biases logging (log.wandb=True): an offline run holds exactly the scalars of
metrics.jsonl and TensorBoard, and the run table and config as its config; without the package
the run is refused in one line before anything is written.

W&B runs offline here (WANDB_MODE=offline), with its settings and caches under the test's
directory: no network, nothing in the user's home. The offline run is read back from its
`.wandb` file, a LevelDB-style log of the protobuf records W&B would upload."""

import glob
import json
import math
import os
import struct
import time
import sys
import zlib

import pytest

from jaxtrain import config as config_lib
from jaxtrain.checkpointing import run_directory
from jaxtrain.train import metrics, wandb as wandb_logger
from jaxtrain.validation import checks as config_checks
from tests.helpers import assert_one_line_config_error, run_cli

# configs/tiny.py's model, on fewer tokens per step and eval (what is logged does not depend on
# them): executing 6 steps and 2 evals of 16x256 tokens took most of the test's time.
TINY = ("--config=configs/tiny.py", "--config.train.steps=6", "--config.train.log_every=1",
        "--config.train.eval_every=3", "--config.log.wandb=True",
        "--config.train.global_batch_size=8", "--config.train.seq_len=64",
        "--config.train.eval_batches=2")


def _offline_env(monkeypatch, tmp_path):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
               "WANDB_ARTIFACT_DIR"):
    monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
  for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_NAME",
               "WANDB_RUN_ID", "WANDB_RESUME"):
    monkeypatch.delenv(name, raising=False)


def _records(path):
  """The protobuf Records of a `.wandb` file: a 7-byte header (":W&B", magic 0xBEE1, version 0),
  then LevelDB log records (crc32, length, type; FULL or FIRST..MIDDLE..LAST pieces) in 32 KiB
  blocks whose tails shorter than a record header are padding."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  with open(path, "rb") as f:
    data = f.read()
  assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
  block, offset, pieces = 32768, 7, b""
  while offset + 7 <= len(data):
    if block - offset % block < 7:
      offset += block - offset % block
      continue
    crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
    piece = data[offset + 7:offset + 7 + length]
    offset += 7 + length
    if kind == 0:  # zero padding at the end of a block
      continue
    assert zlib.crc32(piece, zlib.crc32(bytes([kind]))) == crc
    pieces += piece
    if kind in (1, 4):  # FULL, LAST
      yield wandb_internal_pb2.Record.FromString(pieces)
      pieces = b""


def _finished_records(path, timeout_s: float = 60.0):
  """The records of a finished run's `.wandb` file, read once its exit record is there: W&B's
  service process writes the file, and on a loaded machine the last records can land a moment
  after `finish()` has returned."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      records = list(_records(path))
    except AssertionError:  # a record being written: its checksum does not match yet
      records = []
    if any(r.WhichOneof("record_type") == "exit" for r in records):
      return records
    assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s:.0f} s"
    time.sleep(0.2)


def _offline_run(workdir):
  """(run record, {step: {key: value}} of the history) of the one offline run in workdir."""
  paths = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
  assert len(paths) == 1, paths
  run, history = None, {}
  for record in _finished_records(paths[0]):
    kind = record.WhichOneof("record_type")
    if kind == "run":
      run = record.run
    elif kind == "history":
      row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
             for item in record.history.item}
      step = row.pop("_step")
      assert step not in history, f"step {step} logged in two rows"
      history[step] = {k: v for k, v in row.items() if not k.startswith("_")}
  assert run is not None
  return run, history


def _tensorboard_scalars(workdir):
  """{step: {tag: value}} of the TensorBoard events in WORKDIR/tensorboard."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  scalars = {}
  for path in glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset + 12 <= len(data):  # TFRecord: uint64 length, uint32 crc, payload, uint32 crc
      length = int.from_bytes(data[offset:offset + 8], "little")
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(event.step, {})[value.tag] = value.simple_value
  return scalars


@pytest.mark.slow(seconds=8)
def test_offline_run_logs_what_metrics_jsonl_and_tensorboard_hold(tmp_path, monkeypatch):
  _offline_env(monkeypatch, tmp_path)
  workdir = tmp_path / "tiny_wandb"
  result = run_cli(*TINY, f"--workdir={workdir}")
  assert result.returncode == 0, result.stdout + result.stderr

  run, history = _offline_run(workdir)
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  train = {r["step"]: r for r in records if "loss" in r}
  evals = {r["step"]: r for r in records if "eval_loss" in r}
  assert sorted(train) == [1, 2, 3, 4, 5, 6] and sorted(evals) == [3, 6]
  assert sorted(history) == sorted(train)  # W&B's step is the training step
  # The losses exactly (float64 JSON both ways), and every other scalar of the records.
  assert {s: history[s]["train/loss"] for s in train} == {s: r["loss"] for s, r in train.items()}
  assert {s: history[s]["eval/loss"] for s in evals} == {s: r["eval_loss"]
                                                          for s, r in evals.items()}
  for step, record in train.items():
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
        assert history[step][f"train/{key}"] == value, (step, key)
  # The names and steps TensorBoard got (which stores float32: values to its precision).
  tensorboard = _tensorboard_scalars(workdir)
  assert {s: sorted(row) for s, row in tensorboard.items()} == {s: sorted(row)
                                                                for s, row in history.items()}
  for step, row in tensorboard.items():
    for tag, value in row.items():
      assert math.isclose(value, history[step][tag], rel_tol=1e-6, abs_tol=1e-30), (step, tag)

  # The run: named after the workdir, its id kept there for a resumed run, and its config the
  # run table as printed plus the config's sections.
  assert (run.project, run.display_name) == ("jaxtrain", "tiny_wandb")
  with open(workdir / run_directory.RUN_ID_FILE, encoding="utf-8") as f:
    assert run.run_id == f.read().strip()
  config = {item.key: json.loads(item.value_json) for item in run.config.update}
  table = metrics.format_table(list(config["run_table"].items()))
  assert table in result.stdout
  assert {"parameters", "model", "steps"} <= set(config["run_table"])
  assert config["train"]["steps"] == 6 and config["train"]["eval_every"] == 3
  assert config["log"]["wandb"] is True and config["model"]["d_model"] == 128


def test_without_the_package_the_run_is_refused_in_one_line(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec gives None
  assert not config_checks.wandb_installed()
  workdir = tmp_path / "run"
  result = run_cli(*TINY, f"--workdir={workdir}")
  assert result.returncode == 2, result.stdout + result.stderr
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr
  for word in ["log.wandb=True", "wandb package is not installed", 'pip install -e ".[wandb]"']:
    assert word in lines[0], (word, lines[0])
  assert not workdir.exists()


def test_a_dry_run_needs_no_wandb_package(monkeypatch):
  """A dry run compiles and logs nothing: log.wandb=True is no reason to refuse it."""
  monkeypatch.setitem(sys.modules, "wandb", None)
  c = config_lib.default_config()
  c.log.wandb = True
  with pytest.raises(config_lib.ConfigError, match="wandb package is not installed"):
    config_checks.validate(c, 1)
  config_checks.validate(c, 1, for_run=False)


def test_empty_project_is_refused():
  c = config_lib.default_config()
  c.log.wandb, c.log.wandb_project = True, ""
  assert_one_line_config_error(c, 8, ["log.wandb_project=''", "--config.log.wandb_project"])


def test_a_resumed_run_keeps_its_wandb_id_and_a_new_run_gets_a_new_one(tmp_path):
  workdir = str(tmp_path)
  first = wandb_logger._run_id(workdir, resumed=False)  # pylint: disable=protected-access
  assert wandb_logger._run_id(workdir, resumed=True) == first  # pylint: disable=protected-access
  second = wandb_logger._run_id(workdir, resumed=False)  # pylint: disable=protected-access
  assert second != first
  assert wandb_logger._run_id(workdir, resumed=True) == second  # pylint: disable=protected-access


def test_a_run_closed_while_an_exception_propagates_is_marked_failed(tmp_path, monkeypatch):
  """The trainer closes its writers in a `finally`: a crashed training run must not show as
  finished in W&B."""
  _offline_env(monkeypatch, tmp_path)
  c = config_lib.default_config()
  c.log.wandb, c.log.wandb_run_name = True, "crash"
  logger = wandb_logger.WandbLogger(c, str(tmp_path / "run"), [("steps", "2")], resumed=False)
  with pytest.raises(RuntimeError):
    try:
      logger.log(1, {"train/loss": 2.5})
      raise RuntimeError("step 2 failed")
    finally:
      logger.close()
  paths = glob.glob(os.path.join(tmp_path, "run", "wandb", "offline-run-*", "run-*.wandb"))
  exits = [r.exit.exit_code for r in _finished_records(paths[0])
           if r.WhichOneof("record_type") == "exit"]
  assert exits == [1]
  run, history = _offline_run(tmp_path / "run")
  assert run.display_name == "crash" and history == {1: {"train/loss": 2.5}}
