"""The run's object-storage paths, checked before a run writes anything (jaxtrain/storage.py)."""

from __future__ import annotations

from jaxtrain import storage
from jaxtrain.config import ConfigError


def check_run_storage(config, workdir: str) -> None:
  """The run's object-storage paths (--workdir, checkpoint.directory, checkpoint.init_from):
  a scheme jaxtrain reads, the cloud extra installed, a bucket that exists and these credentials
  see, and an init_from that is there. Raises ConfigError (one line) before anything is written;
  reaches the bucket, so it is checked for a run, not for a dry run."""
  c = config.checkpoint
  for key, path in (("--workdir", workdir), ("checkpoint.directory", c.directory),
                    ("checkpoint.init_from", c.init_from)):
    if not path or not storage.is_url(path):
      continue
    try:
      storage.check_url(path, key)
      storage.check_bucket(path, key)
      if key == "checkpoint.init_from" and not storage.isdir(path):
        raise ConfigError(f"checkpoint.init_from={path!r}: nothing there; give a run's workdir "
                          f"or checkpoint step on the bucket, or a converted-weights directory")
    except storage.StorageError as e:
      raise ConfigError(str(e)) from None
