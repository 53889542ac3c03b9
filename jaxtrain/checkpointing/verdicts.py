"""What a failed checkpoint restore means, and one verdict that every process of a run shares.

Only a recognised corruption of the checkpoint's own files lets a run set a step aside and try
the one before it: a missing file, a truncated or undecodable one (TensorStore's NOT_FOUND,
OUT_OF_RANGE and DATA_LOSS statuses, FAILED_PRECONDITION for a truncated or undecodable stream,
a JSON parse error of Orbax's metadata), or an item the step lacks. Everything else -- a device out of memory while resuming on a smaller mesh, a
permission or credentials error, a plain bug -- says nothing about the checkpoint, so the run
stops and renames nothing. Errors of a storage service that is briefly unreachable are transient:
retried once, then the run stops the same way.

The verdicts are ordered by how much they forbid: OK < CORRUPT < TRANSIENT < FATAL. Processes
agree by taking the largest (one process that cannot read its shards makes the step unreadable
for all; one process out of memory stops all), so they restore, skip or stop together and only
then does process 0 rename anything.
"""

from __future__ import annotations

import enum
import json

import jax
from jax.experimental import multihost_utils
import numpy as np


class Verdict(enum.IntEnum):
  OK = 0
  CORRUPT = 1
  TRANSIENT = 2
  FATAL = 3


class CheckpointRestoreError(RuntimeError):
  """The run cannot resume from its checkpoints and must not start over silently; the message is
  one line naming the step(s), the error and what to do."""


class CheckpointCorrupted(RuntimeError):
  """A step found incomplete by jaxtrain's own checks (an item or its metadata missing)."""


class PeerFailed(RuntimeError):
  """This process's stand-in for an error that another process met: its verdict is the one
  the processes agreed on."""

  def __init__(self, verdict: "Verdict"):
    super().__init__(f"another process of this run could not read it ({verdict.name.lower()})")
    self.verdict = verdict


# TensorStore reports a file that is gone, shorter than its index says, or fails its checksum /
# decoding with these status codes (the message starts with the code).
_CORRUPT_STATUSES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS")
_FILE_DAMAGE_WORDS = ("Truncated", "Error decoding", "checksum", "corrupt")
# A storage service or network that is briefly unavailable (TensorStore, gRPC, HTTP clients).
_TRANSIENT_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
_TRANSIENT_NAMES = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                    "ConnectionClosedError", "ResponseStreamingError", "ServerDisconnectedError",
                    "ClientConnectorError", "ClientOSError", "ServiceUnavailable",
                    "TooManyRequests", "SlowDown", "RetryError")
# Never the checkpoint's fault, whatever else the message holds.
_FATAL_STATUSES = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAUTHENTICATED", "INTERNAL")


def classify(error: BaseException) -> Verdict:
  """The verdict of one process's restore error. The error itself decides where it is
  recognised, else the exceptions it was raised from (an Orbax wrapper around TensorStore's);
  an error recognised nowhere is FATAL: stopping is the safe answer to the unknown."""
  seen = set()
  link = error
  while link is not None and id(link) not in seen:
    seen.add(id(link))
    verdict = _classify_one(link)
    if verdict is not None:
      return verdict
    link = link.__cause__ or link.__context__
  return Verdict.FATAL


def _classify_one(e: BaseException) -> Verdict | None:
  if isinstance(e, BaseExceptionGroup):  # concurrent reads: the worst of them
    return max((classify(x) for x in e.exceptions), default=Verdict.FATAL)
  if isinstance(e, PeerFailed):
    return e.verdict
  if isinstance(e, MemoryError):
    return Verdict.FATAL
  if isinstance(e, (CheckpointCorrupted, FileNotFoundError, json.JSONDecodeError)):
    return Verdict.CORRUPT
  if isinstance(e, (ConnectionError, TimeoutError)):
    return Verdict.TRANSIENT
  if type(e).__name__ in _TRANSIENT_NAMES:
    return Verdict.TRANSIENT
  status = str(e).lstrip().split(":", 1)[0].strip()
  if status in _FATAL_STATUSES:
    return Verdict.FATAL
  if status in _TRANSIENT_STATUSES:
    return Verdict.TRANSIENT
  if status in _CORRUPT_STATUSES:
    return Verdict.CORRUPT
  # TensorStore's answer to an OCDBT database whose data files are gone or cut short ("Error
  # reading "a/0" in OCDBT database ...: Truncated Zstd-compressed stream"); the status alone
  # is used for other things too.
  if status == "FAILED_PRECONDITION" and any(w in str(e) for w in _FILE_DAMAGE_WORDS):
    return Verdict.CORRUPT
  return None


def agree(verdict: Verdict) -> Verdict:
  """The run's verdict: the largest of every process's (the same on all of them)."""
  if jax.process_count() == 1:
    return verdict
  verdicts = multihost_utils.process_allgather(np.int32(int(verdict)))
  return Verdict(int(np.max(verdicts)))


def describe(error: BaseException | None) -> str:
  """`Type: first line of the message`, at most 300 characters."""
  if error is None:
    return "another process could not read it"
  text = str(error).strip()
  first = text.splitlines()[0][:300] if text else ""
  return f"{type(error).__name__}: {first}" if first else type(error).__name__
