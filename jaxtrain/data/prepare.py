"""Tokenize a corpus once into flat token-array shards plus a manifest (`python -m ...prepare`).

    python -m jaxtrain.data.prepare --input 'data/*.jsonl' --format jsonl --field text \\
        --tokenizer hf:/path/tokenizer.json --output DIR [--num_workers N]

Shard i holds documents [i * docs_per_shard, (i + 1) * docs_per_shard) of the source, in source
order, so the output does not depend on the number of worker processes. Each shard is written by
`write_token_shard` as `shard-00003-of-00012.bin` (the tokens, back to back, uint16 when the
tokenizer's ids fit, else uint32) and `shard-00003-of-00012.idx.npy` (document offsets). Train on
the directory, which `PreparedCorpus` memory-maps and reads piece by piece:

    python -m jaxtrain.main ... --config.data.source=prepared --config.data.train_paths=DIR

`DIR/manifest.json` (version 2) is written last and atomically: a directory without one holds a
run that did not finish. `read_manifest(DIR)` checks that a prepared corpus is complete.
"""

from __future__ import annotations

# `input` and `format` name the arguments as the command line does.
# pylint: disable=redefined-builtin

import argparse
import concurrent.futures
import importlib
import json
import math
import multiprocessing
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from jaxtrain.config import ConfigError
from jaxtrain.data.sources import (DataError, JsonlSource, ParquetSource, TextFileSource,
                                   token_dtype, write_token_shard)
from jaxtrain.data.sources import prepared
from jaxtrain.data.tokenizer import Tokenizer, load_tokenizer

FORMATS = ("text", "jsonl", "parquet")
ON_BAD_RECORD = ("fail", "skip")
MANIFEST_NAME = prepared.MANIFEST_NAME
MANIFEST_VERSION = prepared.MANIFEST_VERSION
# Bad records whose reason is printed when skipping; the count is in the manifest.
_MAX_SKIP_REASONS = 5
# Every file a run writes into DIR (shards, indexes, temporaries of a crashed run), and those of
# the version-1 format (.arrayrecord with .lengths.npy sidecars). Only these are removed when DIR
# is reused, so DIR never mixes shards of two runs and an old run's files do not linger.
_OWN_FILE_RE = re.compile(r"shard-\d{5,}-of-\d{5,}(\.bin|\.idx\.npy|\.arrayrecord(\.lengths\.npy)?)"
                          r"(\.tmp-\d+.*)?|manifest\.json\.tmp-\d+")


def shard_name(index: int, num_shards: int) -> str:
  """The shard's file prefix: `write_token_shard` adds `.bin` and `.idx.npy`."""
  return f"shard-{index:05d}-of-{num_shards:05d}"


def _human(n: float) -> str:
  """2100000 -> "2.1M": short counts for progress lines."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.1f}{unit}"
  return f"{n:.0f}"


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
_SMALL_INPUT_BYTES = 64 << 20

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
  _SMALL_INPUT_BYTES, which one process finishes before a pool would have paid for its start-up.
  Processes never outnumber shards. A tokenizer whose batches run on its library's threads
  (`Tokenizer.batch_threads`, the HF kind) gets the CPUs divided among the processes: left
  alone, every process would start a thread per CPU and they would fight over the cores, and
  with fewer processes than CPUs (a small input, few shards, or a smaller `num_workers`) the
  threads keep every CPU busy. Other tokenizers encode under the GIL; their threads read 1.
  """
  cpus = _available_cpus()
  if num_workers is None:
    num_workers = 1 if input_bytes < _SMALL_INPUT_BYTES else cpus
  processes = max(1, min(num_workers, num_shards))
  if not tokenizer.batch_threads:
    return processes, 1
  return processes, _exported_threads() or max(1, cpus // processes)


def _check_args(format: str, on_bad_record: str, num_workers: int | None,
                docs_per_shard: int) -> None:
  """Validates the plain arguments."""
  if format not in FORMATS:
    raise ConfigError(f"format={format!r}: choose one of {', '.join(FORMATS)}")
  if on_bad_record not in ON_BAD_RECORD:
    raise ConfigError(f"on_bad_record={on_bad_record!r}: choose 'fail' or 'skip'")
  if isinstance(docs_per_shard, bool) or not isinstance(docs_per_shard, int) or docs_per_shard < 1:
    raise ConfigError(f"docs_per_shard={docs_per_shard!r}: must be a positive integer")
  if num_workers is not None and (isinstance(num_workers, bool) or
                                  not isinstance(num_workers, int) or num_workers < 1):
    raise ConfigError(f"num_workers={num_workers!r}: must be a positive integer (or None to "
                      f"choose from the CPUs and the tokenizer)")


def _check_output(output: str, overwrite: bool) -> str:
  """Absolute output directory; DataError when it is a file or already holds a finished run."""
  output = os.path.abspath(os.path.expanduser(os.fspath(output)))
  if os.path.exists(output) and not os.path.isdir(output):
    raise DataError(f"output {output} is a file; name a directory for the shards")
  if os.path.exists(os.path.join(output, MANIFEST_NAME)) and not overwrite:
    raise DataError(f"output {output} already holds a prepared corpus ({MANIFEST_NAME}); pass "
                    f"--overwrite (overwrite=True) to replace it, or choose another directory")
  return output


def _load_tokenizer(tokenizer: str | Tokenizer, add_bos: bool, add_eos: bool) -> Tokenizer:
  tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
  # Fails now, not in every worker, when a flag asks for a special the tokenizer lacks.
  tok.encode_document("", add_bos=add_bos, add_eos=add_eos)
  return tok


def open_source(input, format: str, field: str, on_bad_record: str):
  """The document source for `input` (a path, glob or list of them) in `format`."""
  if format == "text":
    return TextFileSource(input, what="input")
  if format == "jsonl":
    return JsonlSource(input, field=field, on_bad_record=on_bad_record, what="input")
  return ParquetSource(input, column=field, what="input")


def _input_bytes(source, enough: int) -> int:
  """Bytes of the files `source` reads (compressed for Parquet), counted only up to `enough`:
  all of a million one-document text files would take a million stat calls."""
  total = 0
  for path in source.paths:
    total += os.path.getsize(path)
    if total >= enough:
      break
  return total


def _clear_output(output: str) -> int:
  """Creates `output`, removing the manifest and shards of an earlier run; files removed."""
  os.makedirs(output, exist_ok=True)
  # The manifest goes first: if removal stops midway, DIR must not look complete.
  removed = 0
  manifest = os.path.join(output, MANIFEST_NAME)
  if os.path.exists(manifest):
    os.remove(manifest)
    removed += 1
  for name in sorted(os.listdir(output)):
    if _OWN_FILE_RE.fullmatch(name):
      os.remove(os.path.join(output, name))
      removed += 1
  return removed


def _remove_temporaries(output: str) -> None:
  """Drops the temporaries of workers killed midway (a failed run); finished shards stay."""
  for name in os.listdir(output):
    if _OWN_FILE_RE.fullmatch(name) and ".tmp-" in name:
      try:
        os.remove(os.path.join(output, name))
      except FileNotFoundError:
        pass  # a worker still running removed or renamed it


# A forkserver child started from `python -m jaxtrain.data.prepare` re-runs this module as its
# `__mp_main__` (multiprocessing's spawn preparation), though the server preloaded it; runpy then
# warns that it is already imported. Harmless, and the filter, set at import in the server, is
# inherited by every worker forked from it.
warnings.filterwarnings("ignore", message=r"'jaxtrain\.data\.prepare' found in sys\.modules",
                        category=RuntimeWarning)


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
          "skip_reasons": skipped[:_MAX_SKIP_REASONS]}


def _pool_context():
  # Never fork: the parent may hold threads (tokenizers' Rust pool, grain). A forkserver
  # imports this module (and jax, via jaxtrain.data) once for all workers; spawn would pay that
  # import in every worker.
  if "forkserver" in multiprocessing.get_all_start_methods():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["jaxtrain.data.prepare"])
    return ctx
  return multiprocessing.get_context("spawn")


def _run_shards(init_args: tuple, num_shards: int, num_workers: int, threads: int):
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


# --- the run ------------------------------------------------------------------------------------


def _write_manifest(output: str, manifest: dict[str, Any]) -> None:
  """Writes the manifest under a temporary name and renames it, so it is whole or absent."""
  path = os.path.join(output, MANIFEST_NAME)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=2)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _manifest(*, input, format, field, tok, tokenizer_spec, dtype, add_bos, add_eos,
              docs_per_shard, on_bad_record, shards, skipped) -> dict[str, Any]:
  return {
      "version": MANIFEST_VERSION,
      "tokenizer": tokenizer_spec,
      "tokenizer_name": tok.name,
      "vocab_size": int(tok.vocab_size),
      "token_dtype": dtype,
      "bos_id": tok.bos_id,
      "eos_id": tok.eos_id,
      "add_bos": bool(add_bos),
      "add_eos": bool(add_eos),
      "input": (os.fspath(input) if isinstance(input, (str, os.PathLike))
                else [os.fspath(p) for p in input]),
      "format": format,
      "field": None if format == "text" else field,
      "docs_per_shard": docs_per_shard,
      "on_bad_record": on_bad_record,
      "shards": shards,
      "totals": {
          "documents": sum(s["documents"] for s in shards),
          "tokens": sum(s["tokens"] for s in shards),
          "shards": len(shards),
      },
      "skipped_records": skipped,
  }


def prepare(input, *, format: str, tokenizer: str | Tokenizer, output: str,
            field: str = "text", add_bos: bool = False, add_eos: bool = True,
            num_workers: int | None = None, docs_per_shard: int = 10000,
            on_bad_record: str = "fail", overwrite: bool = False,
            log: Callable[[str], None] | None = print) -> dict[str, Any]:
  """Tokenizes `input` into token-array shards under `output`; returns the manifest written.

  Args:
    input: a path, glob or list of them (see `resolve_paths`).
    format: "text" (one document per file), "jsonl" (`field` of each line) or "parquet" (column
      `field`).
    tokenizer: a `load_tokenizer` spec ("byte", "hf:PATH", "sentencepiece:PATH") or a Tokenizer.
    output: directory for the shards and `manifest.json`; created if missing.
    field: JSONL field or Parquet column holding the text.
    add_bos, add_eos: add BOS / EOS to every document (`Tokenizer.encode_document`).
    num_workers: tokenizing processes; None: one per CPU, or one for an input under 64 MiB (see
      `worker_plan`, also for the HF tokenizer's threads). Never more than there are shards.
      The output is the same for any number.
    docs_per_shard: documents per shard (the last shard holds the rest).
    on_bad_record: "fail" stops at the first bad record; "skip" leaves bad records out and
      counts them in the manifest's `skipped_records`.
    overwrite: replace a finished run in `output`; without it such a directory is refused.
    log: called with each progress line; None for silence.

  Raises:
    DataError: unusable input or output (no files, bad records, empty corpus, output taken).
    ConfigError: bad arguments or tokenizer.
  """
  log = log or (lambda _: None)
  start = time.perf_counter()
  _check_args(format, on_bad_record, num_workers, docs_per_shard)
  output = _check_output(output, overwrite)
  tok = _load_tokenizer(tokenizer, add_bos, add_eos)
  tokenizer_spec = tok.name if isinstance(tokenizer, Tokenizer) else tokenizer
  dtype = token_dtype(tok.vocab_size)
  source = open_source(input, format, field, on_bad_record)
  # Only now, with input and tokenizer known good, is an earlier run's output removed.
  removed = _clear_output(output)
  if removed:
    log(f"removed {removed} files of an earlier run from {output}")

  num_shards = math.ceil(len(source) / docs_per_shard)
  workers, threads = worker_plan(tok, num_workers, num_shards,
                                 _input_bytes(source, _SMALL_INPUT_BYTES))
  per_worker = (f" ({threads} tokenizer thread{'s' if threads > 1 else ''} each)"
                if tok.batch_threads else "")
  log(f"prepare: {source.describe()} -> {num_shards} shards in {output}, {workers} workers"
      f"{per_worker}, tokenizer {tok.name}, tokens as {dtype}")
  init_args = (source, tok, add_bos, add_eos, on_bad_record == "skip", output, docs_per_shard,
               num_shards, dtype)
  shards, skip_reasons = [], list(getattr(source, "skip_reasons", []))
  skipped = getattr(source, "skipped", 0)  # JSONL skips bad lines while indexing
  results = _run_shards(init_args, num_shards, workers, threads)
  try:
    for entry in results:
      skipped += entry.pop("skipped")
      skip_reasons.extend(entry.pop("skip_reasons"))
      shards.append(entry)
      extra = f", {skipped} skipped so far" if skipped else ""
      log(f"shard {len(shards)}/{num_shards}: {entry['documents']} docs, "
          f"{_human(entry['tokens'])} tokens{extra}")
  except BaseException:
    results.close()  # stops the workers before their temporaries are removed
    _remove_temporaries(output)
    raise

  manifest = _manifest(input=input, format=format, field=field, tok=tok,
                       tokenizer_spec=tokenizer_spec, dtype=dtype, add_bos=add_bos,
                       add_eos=add_eos, docs_per_shard=docs_per_shard,
                       on_bad_record=on_bad_record, shards=shards, skipped=skipped)
  totals = manifest["totals"]
  if totals["documents"] == 0:
    raise DataError(f"input {input!r}: empty corpus: all {skipped} records were bad and skipped, "
                    f"e.g. {skip_reasons[0] if skip_reasons else '?'}")
  _write_manifest(output, manifest)

  elapsed = time.perf_counter() - start
  tokens_per_sec = int(totals["tokens"] / max(elapsed, 1e-9))
  if skipped:
    log(f"skipped {skipped} bad records, e.g.:")
    for reason in skip_reasons[:_MAX_SKIP_REASONS]:
      log(f"  {reason}")
  log(f"wrote {totals['documents']} documents, {_human(totals['tokens'])} tokens in "
      f"{totals['shards']} shards to {output} in {elapsed:.1f}s "
      f"({_human(tokens_per_sec)} tokens/s)")
  log(f"prepare: documents={totals['documents']} tokens={totals['tokens']} "
      f"shards={totals['shards']} tokens_per_sec={tokens_per_sec}")
  return manifest


def read_manifest(directory: str) -> dict[str, Any]:
  """The manifest of a prepared corpus in `directory`, checked to be complete.

  Checks what the manifest lists (both files of every shard), not the files' contents:
  `PreparedCorpus(directory)` checks those too.

  Raises:
    DataError: no manifest (not prepared, or a run that did not finish), an unreadable,
      malformed or unknown-version manifest (version 1: the old ArrayRecord format, with the
      command that re-prepares it), or a shard file it lists that is missing.
  """
  return prepared.load_manifest(directory)[1]


# --- command line -------------------------------------------------------------------------------

# Config-key wording in the sources' messages, as the command line spells it.
_CLI_WORDS = (("data.input", "--input"), ("data.field", "--field"),
              ("on_bad_record='skip'", "--on_bad_record=skip"),
              ("--overwrite (overwrite=True)", "--overwrite"))


def _cli_message(e: Exception) -> str:
  message = " ".join(str(e).split())  # one line, whatever the exception held
  for old, new in _CLI_WORDS:
    message = message.replace(old, new)
  return message


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m jaxtrain.data.prepare",
      description="Tokenize a corpus once into token-array shards (.bin + .idx.npy) plus "
                  "DIR/manifest.json; train with --config.data.source=prepared "
                  "--config.data.train_paths=DIR.")
  p.add_argument("--input", required=True, nargs="+",
                 help="files or globs (quote globs); several may follow --input")
  p.add_argument("--format", required=True, choices=FORMATS,
                 help="text: one document per file; jsonl: --field of each line; parquet: "
                      "column --field")
  p.add_argument("--field", default="text", help="JSONL field or Parquet column (default: text)")
  p.add_argument("--tokenizer", required=True,
                 help="byte | hf:PATH (tokenizer.json) | sentencepiece:PATH (.model)")
  p.add_argument("--output", required=True, help="directory for the shards and manifest.json")
  p.add_argument("--add_bos", dest="add_bos", action="store_true", help="BOS before each document")
  p.add_argument("--no_add_bos", dest="add_bos", action="store_false", help="(default)")
  p.add_argument("--add_eos", dest="add_eos", action="store_true",
                 help="EOS after each document (default)")
  p.add_argument("--no_add_eos", dest="add_eos", action="store_false")
  p.set_defaults(add_bos=False, add_eos=True)
  p.add_argument("--num_workers", type=int, default=None,
                 help="tokenizing processes (default: one per CPU; one for an input under "
                      "64 MiB)")
  p.add_argument("--docs_per_shard", type=int, default=10000)
  p.add_argument("--on_bad_record", choices=ON_BAD_RECORD, default="fail")
  p.add_argument("--overwrite", action="store_true", help="replace a finished run in --output")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    prepare(args.input[0] if len(args.input) == 1 else args.input, format=args.format,
            tokenizer=args.tokenizer, output=args.output, field=args.field,
            add_bos=args.add_bos, add_eos=args.add_eos, num_workers=args.num_workers,
            docs_per_shard=args.docs_per_shard, on_bad_record=args.on_bad_record,
            overwrite=args.overwrite, log=lambda line: print(line, flush=True))
  except (DataError, ConfigError) as e:
    print(f"error: {_cli_message(e)}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("error: interrupted; the output has no manifest and is incomplete", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  # Run the importable module's `main`: worker functions must pickle as
  # `jaxtrain.data.prepare._write_shard`; a forkserver child has no `__main__._write_shard`.
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()
  sys.exit(importlib.import_module("jaxtrain.data.prepare").main())
