"""A live run on a bucket and what reads it or pushes to it at the same time, against the S3
server the tests start on the loopback interface (tests/object_store.py).

Retention (checkpointing/mirror.py) deletes a step marker first, and the readers of a run's newest
step (init_from, `python -m jaxtrain.generate`, the Hugging Face export) that find it removed
while they read it read the then newest complete step instead, once, with a note. A bucket
workdir's pushes (run_directory.py) send each byte about once: closed TensorBoard event files
once, appended files by their new bytes, so a long run's upload traffic grows with its length,
not its square.
"""

import json
import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxtrain import storage
from jaxtrain.checkpointing import mirror as checkpoint_mirror, run_directory
from jaxtrain.checkpointing import weights as checkpoint_weights
from jaxtrain.interop import hf, hf_storage
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.sharding import abstract_model, init_params
from jaxtrain.parallel.mesh import make_mesh
from jaxtrain.train import metrics
from tests.helpers import absl_cli_module, assert_same_safetensors, small_config
from tests.object_store import s3_server

MARKER = checkpoint_mirror.COMMIT_MARKER


@pytest.fixture(scope="module")
def s3():
  with s3_server() as (_, bucket):
    yield f"s3://{bucket}"


# --- retention and the readers of a live run -------------------------------------------------

@pytest.fixture(scope="module")
def steps(tmp_path_factory):
  """{step: local step directory} of a small Llama's run, steps 8 and 12 (different weights),
  each as the uploader leaves it on a bucket (state/, meta/, the marker), and the model's
  (config, abstract params)."""
  config = small_config()
  mesh = make_mesh(devices=jax.devices()[:1])
  cfg = ModelConfig.from_config(config)
  _, abstract, _ = abstract_model(cfg, mesh)
  root = tmp_path_factory.mktemp("run")
  out = {}
  for step in (8, 12):
    _, params = init_params(cfg, mesh, seed=step)
    directory = root / str(step)
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(str(directory / "state"), {"params": params, "step": np.int32(step)})
      ckptr.wait_until_finished()
    (directory / "meta").mkdir()
    (directory / "meta" / "metadata").write_text(json.dumps({"config": config.to_dict()}))
    (directory / MARKER).write_text("")
    out[step] = str(directory)
  return out, config, abstract


def _client():
  """The s3fs client every s3:// call of this process goes through (fsspec keeps one)."""
  fs, _ = storage._filesystem("s3://any")  # pylint: disable=protected-access
  return fs


def _put_step(url, local_step):
  """Uploads a step as the uploader does: its files, then the marker."""
  storage.upload_dir(local_step, url, exclude=(MARKER,))
  storage.write_bytes(f"{url}/{MARKER}", b"")


def _live_run(s3, name, steps):
  """A run's workdir on the bucket holding its step 8 alone; returns its URL."""
  url = f"{s3}/{name}"
  _put_step(f"{url}/checkpoints/8", steps[8])
  return url


@pytest.fixture
def retention_during_download(monkeypatch):
  """arm(url, steps): the first download from the run at `url`'s step 8 finds, between its
  listing and its transfer, that the run saved step 12 and its retention (max_to_keep=1)
  deleted step 8, as a live run does. Returns the list of step URLs downloaded from."""
  fs = _client()
  real_get = fs.get
  armed, downloads = {}, []

  def get(rpath, lpath, *args, **kwargs):
    paths = rpath if isinstance(rpath, list) else [rpath]
    step_dirs = {m.group(0) for p in paths if (m := re.search(r".*/checkpoints/\d+", p))}
    downloads.extend(sorted(step_dirs))
    url = armed.get("url")
    if url and any(d.endswith(f"{url.partition('://')[2]}/checkpoints/8") for d in step_dirs):
      armed.clear()
      _put_step(f"{url}/checkpoints/12", armed_steps[12])
      checkpoint_mirror.CheckpointMirror(f"{url}/checkpoints", max_to_keep=1,
                                         keep_period=None).prune(newest=12)
    return real_get(rpath, lpath, *args, **kwargs)
  monkeypatch.setattr(fs, "get", get)
  armed_steps = {}

  def arm(url, steps):
    armed["url"] = url
    armed_steps.update(steps)
    return downloads
  return arm


def _assert_note(capsys, url):
  out = capsys.readouterr().out
  assert (f"note: step 8 of {url} was removed while it was read (the run's retention); "
          f"reading step 12 instead") in out, out


def _same_tree(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def test_retention_deletes_a_step_marker_first(s3, monkeypatch):
  """A reader never finds a marked step with files missing: the marker's delete is answered
  before any other file of the step is deleted (pruning and a cut-short upload's leftovers)."""
  deletes = []
  fs = _client()
  real_rm = fs.rm
  monkeypatch.setattr(fs, "rm", lambda path, *a, **k: (
      deletes.append(sorted(path if isinstance(path, list) else [path])),
      real_rm(path, *a, **k))[1])
  url = f"{s3}/retention/checkpoints"
  mirror = checkpoint_mirror.CheckpointMirror(url, max_to_keep=1, keep_period=None)
  for step in (1, 2):
    for name in ("state/array", "state/_METADATA", "meta/metadata", MARKER):
      path = os.path.join(mirror.local, str(step), name)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w", encoding="utf-8") as f:
        f.write("x")
    mirror.upload(step)  # step 2's upload prunes step 1
  assert mirror.complete_steps() == [2] and storage.listdir(url) == ["2"]
  mirror.upload(2)  # again: the leftovers of "a cut-short upload" of step 2 are deleted first
  for step in (1, 2):
    calls = [c for c in deletes if any(f"/checkpoints/{step}/" in p for p in c)]
    assert calls, deletes
    assert calls[0] == [f"{url[5:]}/{step}/{MARKER}"], (
        f"step {step}: the first delete was {calls[0]}, not the marker alone")
  assert mirror.complete_steps() == [2]


@pytest.mark.parametrize("where", ["workdir", "checkpoints"])
def test_init_from_a_live_run_reads_the_next_step_when_retention_removes_one(
    s3, steps, retention_during_download, capsys, where):
  local_steps, _, abstract = steps
  url = _live_run(s3, f"init-from-{where}", local_steps)
  downloads = retention_during_download(url, local_steps)
  given = url if where == "workdir" else f"{url}/checkpoints"
  params, source = checkpoint_weights.load_params(given, abstract)
  _assert_note(capsys, given)
  assert [d.rsplit("/", 1)[-1] for d in downloads] == ["8", "12"]
  want, _ = checkpoint_weights.load_params(local_steps[12], abstract)
  assert _same_tree(params, want) and "/checkpoints/12/" in source
  # The copy of the removed step is not kept: asked again, init_from reads step 12 alone.
  capsys.readouterr()
  again, _ = checkpoint_weights.load_params(given, abstract)
  assert _same_tree(again, want) and "note:" not in capsys.readouterr().out


def test_generate_from_a_live_run_reads_the_next_step_when_retention_removes_one(
    s3, steps, retention_during_download, capsys):
  local_steps, _, _ = steps
  url = _live_run(s3, "generate", local_steps)
  retention_during_download(url, local_steps)
  # `python -m jaxtrain.generate --checkpoint=URL`'s loading (its flags kept apart from main's).
  with absl_cli_module("jaxtrain.generate.cli") as generate_cli:
    model, _ = generate_cli.load(url)
    _assert_note(capsys, url)
    want, _ = generate_cli.load(local_steps[12])
  assert _same_tree(nnx.state(model), nnx.state(want))


def test_export_of_a_live_run_reads_the_next_step_when_retention_removes_one(
    s3, steps, retention_during_download, capsys, tmp_path):
  local_steps, _, _ = steps
  url = _live_run(s3, "export", local_steps)
  retention_during_download(url, local_steps)
  out, want = str(tmp_path / "hf"), str(tmp_path / "want")
  assert hf.main(["export", f"--checkpoint={url}", f"--out={out}"]) == 0
  _assert_note(capsys, url)
  assert hf.main(["export", f"--checkpoint={local_steps[12]}", f"--out={want}"]) == 0
  assert_same_safetensors(out, want)
  staged = storage.staging_path(f"s3://{hf_storage.EXPORT_AREA}/{url[5:]}")
  assert os.listdir(os.path.join(staged, "checkpoints")) == ["12"]


def test_a_step_that_fails_to_read_but_is_still_there_is_an_error_not_a_retry(s3, steps,
                                                                                 monkeypatch):
  """Only a removed step is replaced: any other failure is said as it was."""
  local_steps, _, abstract = steps
  url = _live_run(s3, "failing", local_steps)
  _put_step(f"{url}/checkpoints/12", local_steps[12])

  def refuse(*_, **__):
    raise storage.StorageError("s3://x: connection reset")
  monkeypatch.setattr(storage, "download_dir", refuse)
  with pytest.raises(storage.StorageError, match="connection reset"):
    checkpoint_weights.load_params(url, abstract)
  with pytest.raises(storage.StorageError, match="connection reset"):
    hf_storage.download_checkpoint(url)


# --- a bucket workdir's pushes ---------------------------------------------------------------

@pytest.fixture
def uploads(monkeypatch):
  """{relative path under the workdir URL: [bytes sent by each call]} of the storage calls a
  RunDirectory's pushes upload through (a whole file, a server-side append's new bytes)."""
  sent: dict[str, list[int]] = {}
  real_upload, real_write, real_append = (storage.upload_dir, storage.write_bytes,
                                          storage.append_bytes)

  def note(url, n):
    sent.setdefault(url.split("/workdir-", 1)[-1].split("/", 1)[-1], []).append(n)

  def upload_dir(local, url, *, only=None, **kwargs):
    copied = real_upload(local, url, only=only, **kwargs)
    for rel in copied:
      note(f"{url}/{rel}", os.path.getsize(os.path.join(local, rel)))
    return copied

  def write_bytes(url, data):
    real_write(url, data)
    note(url, len(data))

  def append_bytes(url, data, *, size):
    done = real_append(url, data, size=size)
    if done:
      note(url, len(data))
    return done
  monkeypatch.setattr(storage, "upload_dir", upload_dir)
  monkeypatch.setattr(storage, "write_bytes", write_bytes)
  monkeypatch.setattr(storage, "append_bytes", append_bytes)
  return sent


def _event_scalars(data: bytes) -> list[tuple[str, int, float]]:
  """(tag, step, value) of every scalar in an event file's bytes (TFRecord framing: uint64
  length, uint32 crc, payload, uint32 crc)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  out, offset = [], 0
  while offset + 12 <= len(data):
    length = int.from_bytes(data[offset:offset + 8], "little")
    event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
    offset += 12 + length + 4
    out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
  return out


def test_tensorboard_events_go_up_once_and_keep_every_scalar(s3, uploads):
  """A run's pushes while its TensorBoard events grow: every closed event file is sent once,
  the open one only by the checkpoints' and the last push, so the bytes sent for TensorBoard
  are the events' own plus at most one open file per checkpoint; the bucket's events hold every
  scalar written, once."""
  url = f"{s3}/workdir-events"
  run_dir = run_directory.RunDirectory(url)
  rotate = 16 * 2**10
  writer = metrics.MetricsWriter(run_dir.local, total_steps=None, print_fn=lambda _: None,
                                 tensorboard_rotate_bytes=rotate)
  written, step, checkpoints = [], 0, 0
  for push in range(1, 41):
    for _ in range(20):
      step += 1
      scalars = {"loss": 1.0 / step, "learning_rate": 1e-3, "grad_norm": float(step),
                 "tokens_per_sec": 1e4 + step, "mfu": 0.25}
      writer.write_train(step, scalars)
      written += [(f"train/{k}", step, v) for k, v in scalars.items()]
    if push % 10 == 0:
      run_dir.push()  # a checkpoint's
      checkpoints += 1
    else:
      run_dir._push(periodic=True)  # pylint: disable=protected-access
  writer.close()
  run_dir.close()
  local = sorted(os.listdir(os.path.join(run_dir.local, "tensorboard")))
  events = {k: v for k, v in uploads.items() if k.startswith("tensorboard/")}
  total = sum(os.path.getsize(os.path.join(run_dir.local, "tensorboard", n)) for n in local)
  sent = sum(sum(v) for v in events.values())
  assert sent <= total + checkpoints * (rotate + 2**10), (
      f"{sent} bytes sent for {total} bytes of TensorBoard events in {len(local)} files")
  assert len(local) > 10  # rotated
  assert sorted(events) == [f"tensorboard/{n}" for n in local]
  assert storage.listdir(f"{url}/tensorboard") == local
  on_bucket = [s for n in local for s in _event_scalars(
      storage.read_bytes(f"{url}/tensorboard/{n}"))]
  assert sorted(on_bucket) == sorted((t, s, pytest.approx(v)) for t, s, v in written)


def test_appended_files_go_up_by_their_new_bytes(s3, uploads):
  """metrics.jsonl growing by 64 KiB between pushes to 8 MiB: copied whole while small (a large
  one less often), then, once the bucket holds 5 MiB of it, by its new lines alone; never a
  torn line; a rewritten file (a resumed run drops records) is copied whole."""
  url = f"{s3}/workdir-jsonl"
  run_dir = run_directory.RunDirectory(url)
  os.makedirs(run_dir.local, exist_ok=True)
  path = os.path.join(run_dir.local, "metrics.jsonl")
  line = (json.dumps({"step": 0, "pad": "x" * 1000}) + "\n").encode()
  growth = 64 * 2**10
  per_push = []
  with open(path, "ab") as f:
    for push in range(128):
      f.write(line * (growth // len(line)) + b'{"torn": ')  # a record still being written
      f.flush()
      before = sum(map(sum, uploads.values()))
      run_dir._push(periodic=True)  # pylint: disable=protected-access
      per_push.append(sum(map(sum, uploads.values())) - before)
      f.seek(0, os.SEEK_END)
      f.truncate(f.tell() - len(b'{"torn": '))
  size = os.path.getsize(path)
  assert size > 8 * 10**6
  on_bucket = storage.read_bytes(f"{url}/metrics.jsonl")
  assert on_bucket == open(path, "rb").read()[:len(on_bucket)] and on_bucket.endswith(b"}\n")
  sent = sum(per_push)
  assert sent < 4 * size, f"{sent} bytes sent for a {size}-byte file in 128 pushes"
  # While small, at most WHOLE_BYTES_PER_PUSH per push on average (and the first copies).
  assert sent <= 128 * (growth + run_directory.WHOLE_BYTES_PER_PUSH), sent
  # Once the bucket's copy holds 5 MiB, a push sends what was added since the last one.
  large = [n for n, pushes in zip(per_push, range(1, 129)) if pushes * growth > 5.5 * 2**20]
  assert large and max(large) <= growth + len(line), large
  # A rewrite (the resumed run's _drop_metrics_after): the whole file, again the bucket's.
  kept = open(path, "rb").read()[:3 * 2**20]
  with open(path + ".tmp", "wb") as f:
    f.write(kept[:kept.rfind(b"\n") + 1])
  os.replace(path + ".tmp", path)
  run_dir.push()
  assert storage.read_bytes(f"{url}/metrics.jsonl") == open(path, "rb").read()


def test_wandb_files_go_up_only_where_needed(s3, uploads):
  """An online W&B run's local files are W&B's cache (it sent them itself): never copied; an
  offline run's directory, its only copy, with each checkpoint and at the end; the run id
  always."""
  url = f"{s3}/workdir-wandb"
  run_dir = run_directory.RunDirectory(url)
  files = {os.path.join("wandb", "jaxtrain_run_id"): b"abc\n",
           os.path.join("wandb", "run-20250101_000000-abc", "files", "output.log"): b"log",
           os.path.join("wandb", "offline-run-20250101_000000-abc", "run-abc.wandb"): b"w" * 99}
  for rel, data in files.items():
    os.makedirs(os.path.dirname(os.path.join(run_dir.local, rel)), exist_ok=True)
    with open(os.path.join(run_dir.local, rel), "wb") as f:
      f.write(data)
  run_dir._push(periodic=True)  # pylint: disable=protected-access
  assert sorted(uploads) == ["wandb/jaxtrain_run_id"]
  run_dir.push()
  assert sorted(uploads) == ["wandb/jaxtrain_run_id",
                             "wandb/offline-run-20250101_000000-abc/run-abc.wandb"]
  assert storage.listdir(f"{url}/wandb") == ["jaxtrain_run_id", "offline-run-20250101_000000-abc"]


def test_on_gs_appended_files_go_up_by_their_new_bytes_from_the_start(uploads, tmp_path):
  """gs:// composes the new bytes after the object (no smallest size): every push after the
  first sends only the lines added since the last."""
  from tests.gcs_store import gcs_server  # pylint: disable=import-outside-toplevel
  with gcs_server() as (_, bucket):
    url = f"gs://{bucket}/workdir-gs"
    run_dir = run_directory.RunDirectory(url)
    os.makedirs(run_dir.local, exist_ok=True)
    path = os.path.join(run_dir.local, "metrics.jsonl")
    per_push, added = [], []
    for push in range(12):
      lines = "".join(json.dumps({"step": push * 10 + i}) + "\n" for i in range(10))
      with open(path, "a", encoding="utf-8") as f:
        f.write(lines)
      added.append(len(lines))
      before = sum(map(sum, uploads.values()))
      run_dir._push(periodic=True)  # pylint: disable=protected-access
      per_push.append(sum(map(sum, uploads.values())) - before)
    assert storage.read_bytes(f"{url}/metrics.jsonl") == open(path, "rb").read()
    assert storage.listdir(url) == ["metrics.jsonl"]  # no part left behind
    assert per_push == added, (per_push, added)
