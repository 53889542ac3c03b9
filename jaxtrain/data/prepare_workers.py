"""The tokenizing processes of `python -m jaxtrain.data.prepare`: how many, and what each does.

`worker_plan` picks the worker processes and the tokenizer threads in each from the CPUs, the
input's size and the tokenizer. Each worker tokenizes whole shards (`_write_shard`: the source's
documents in batches, written by `write_token_shard`); `run_shards` runs them in a process pool,
or in-process for one worker, and yields their manifest entries in shard order.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from typing import Any

from jaxtrain.data.prepare_output import shard_name
from jaxtrain.data.sources import DataError, write_token_shard
from jaxtrain.data.tokenizer import Tokenizer

# Bad records whose reason is printed when skipping; the count is in the manifest.
MAX_SKIP_REASONS = 5


def _available_cpus() -> int:
  # The CPUs this process may run on: os.cpu_count() counts the host's, which overcommits in a
  # container or under taskset.
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


# Inputs smaller than this are tokenized in-process by default: a worker pool costs ~2.5 s to
# start (each worker imports jax), and one process has all the CPUs for an HF tokenizer's threads.
# Measured on 2 CPUs (stdlib .py files as JSONL, 8k-vocab BPE), one process of 2 threads against
# two of 1: 33 MB 8-11 s vs 10-13 s, 65 MB even (~18-20 s), 130 MB 35 s vs 33 s; two processes
# win at scale, as they run the Python between batches in parallel too. For the byte tokenizer
# (~50 MB/s in one process) a pool only pays off from ~250 MB; one threshold serves both.
SMALL_INPUT_BYTES = 64 << 20

# What sizes the HF tokenizer's thread pool: `tokenizers` 0.22-0.23 encode batches on rayon's
# global pool, which reads RAYON_NUM_THREADS when it is built; later releases build their own
# pool from TOKENIZERS_NUM_THREADS. Workers get both; a value the user exported wins.
_THREAD_ENV_VARS = ("RAYON_NUM_THREADS", "TOKENIZERS_NUM_THREADS")


def _exported_threads() -> int | None:
  """The tokenizer thread count the user exported (see _THREAD_ENV_VARS), None when unset."""
  for var in _THREAD_ENV_VARS:
    value = os.environ.get(var, "").strip()
    if value.isdigit() and int(value) > 0:
      return int(value)
  return None


def worker_plan(tokenizer: Tokenizer, num_workers: int | None, num_shards: int,
                input_bytes: int) -> tuple[int, int]:
  """(worker processes, tokenizer threads in each) for `num_shards` shards of `input_bytes`.

  By default (`num_workers` None) there is a process per CPU, except for an input under
  SMALL_INPUT_BYTES, which one process finishes before a pool would have paid for its start-up.
  Processes never outnumber shards. A tokenizer whose batches run on its library's threads
  (`Tokenizer.batch_threads`, the HF kind) gets the CPUs divided among the processes: left
  alone, every process would start a thread per CPU and they would fight over the cores, and
  with fewer processes than CPUs (a small input, few shards, or a smaller `num_workers`) the
  threads keep every CPU busy. Other tokenizers encode under the GIL; their threads read 1.
  """
  cpus = _available_cpus()
  if num_workers is None:
    num_workers = 1 if input_bytes < SMALL_INPUT_BYTES else cpus
  processes = max(1, min(num_workers, num_shards))
  if not tokenizer.batch_threads:
    return processes, 1
  return processes, _exported_threads() or max(1, cpus // processes)


# --- the work of one shard, in a worker process (or in-process for one worker) ------------------

# Documents per `Tokenizer.encode_documents` call: enough for the HF tokenizer's threads to share
# (it hands out whole documents) with little waiting on the batch's longest one. A batch also ends
# past _BATCH_CHARS characters, so that a run of huge documents and their int32 ids stays a few
# hundred MB at most.
_BATCH_DOCS = 256
_BATCH_CHARS = 1 << 25

# Set once per worker process by `_init_worker`: the source and tokenizer arrive pickled once per
# worker, not once per shard.
_state: dict[str, Any] = {}


def _init_worker(source, tokenizer: Tokenizer, add_bos: bool, add_eos: bool, skip: bool,
                 output: str, docs_per_shard: int, num_shards: int, dtype: str,
                 threads: int | None = None) -> None:
  """Stores the run's arguments; in a worker process (`threads` given) also caps the tokenizer's
  threads to the worker's share of the CPUs (see `worker_plan`)."""
  if threads is not None and tokenizer.batch_threads:
    # Read when the pool is built, at the worker's first batch: nothing has encoded in this
    # fresh process yet. A value the user exported is kept (`threads` is that value then).
    for var in _THREAD_ENV_VARS:
      os.environ.setdefault(var, str(threads))
  _state.update(source=source, tokenizer=tokenizer, add_bos=add_bos, add_eos=add_eos, skip=skip,
                output=output, docs_per_shard=docs_per_shard, num_shards=num_shards, dtype=dtype)


def _write_shard(index: int) -> dict[str, Any]:
  """Tokenizes documents of shard `index` and writes it; its manifest entry plus skip info."""
  s = _state
  source, tokenizer = s["source"], s["tokenizer"]
  lo = index * s["docs_per_shard"]
  hi = min(lo + s["docs_per_shard"], len(source))
  skipped = []

  def batches():
    """The shard's good texts in order, in lists of at most _BATCH_DOCS docs / ~_BATCH_CHARS."""
    batch, chars = [], 0
    for d in range(lo, hi):
      try:
        text = source[d]
      except DataError as e:
        if not s["skip"]:
          raise
        skipped.append(str(e))
        continue
      batch.append(text)
      chars += len(text)
      if len(batch) == _BATCH_DOCS or chars >= _BATCH_CHARS:
        yield batch
        batch, chars = [], 0
    if batch:
      yield batch

  def docs():
    for batch in batches():
      yield from tokenizer.encode_documents(batch, add_bos=s["add_bos"], add_eos=s["add_eos"])

  name = shard_name(index, s["num_shards"])
  num_docs, num_tokens = write_token_shard(os.path.join(s["output"], name), docs(), s["dtype"])
  return {"file": name, "documents": num_docs, "tokens": num_tokens, "skipped": len(skipped),
          "skip_reasons": skipped[:MAX_SKIP_REASONS]}


def _pool_context():
  # Never fork: the parent may hold threads (tokenizers' Rust pool, grain). A forkserver
  # imports jaxtrain.data.prepare (with it this module, and jax via jaxtrain.data) once for all
  # workers; spawn would pay that import in every worker.
  if "forkserver" in multiprocessing.get_all_start_methods():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["jaxtrain.data.prepare"])
    return ctx
  return multiprocessing.get_context("spawn")


def run_shards(init_args: tuple, num_shards: int, num_workers: int, threads: int):
  """Yields the shard entries in shard order as they finish."""
  if num_workers == 1:
    # In-process: no worker start-up, and tracebacks point at the failing document directly.
    # The tokenizer's threads are left at the library's default (one per CPU, this plan's count
    # for one process): rayon's pool may already exist here, and the caller's environment is
    # not prepare's to change.
    _init_worker(*init_args)
    try:
      for i in range(num_shards):
        yield _write_shard(i)
    finally:
      _state.clear()
    return
  # Not multiprocessing.Pool: it replaces a worker that dies (OOM-killed, or failing at start-up)
  # and waits forever for the lost shard; the executor raises BrokenProcessPool instead.
  executor = concurrent.futures.ProcessPoolExecutor(
      num_workers, mp_context=_pool_context(), initializer=_init_worker,
      initargs=(*init_args, threads))
  try:
    futures = [executor.submit(_write_shard, i) for i in range(num_shards)]
    # In shard order: progress lines and manifest entries come in order, and contiguous
    # equal-sized shards finish in about that order anyway.
    for future in futures:
      yield future.result()
  finally:
    # After a failure, pending shards are dropped; running ones finish their current shard.
    executor.shutdown(wait=True, cancel_futures=True)
