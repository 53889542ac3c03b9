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

`--input` and `--output` may be s3:// or gs:// URLs. Input objects are downloaded into a local
cache before the workers start (sources/remote_files.py). An output URL is built in the local
directory `storage.staging_path(URL)` and uploaded when the run has succeeded, manifest.json last;
an earlier corpus at the URL is removed only then, and the staging copy after.

This module is the run and its command line; the worker processes that tokenize the shards are
in prepare_workers.py, the output directory's files and manifest in prepare_output.py.
"""

from __future__ import annotations

# `input` and `format` name the arguments as the command line does.
# pylint: disable=redefined-builtin

import argparse
import importlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from jaxtrain import storage
from jaxtrain.config import ConfigError
from jaxtrain.data.prepare_output import (check_output, check_remote_output, clear_output,
                                          make_manifest, publish, read_manifest,
                                          remove_staging, remove_temporaries, write_manifest)
from jaxtrain.data.prepare_workers import (MAX_SKIP_REASONS, SMALL_INPUT_BYTES, run_shards,
                                           worker_plan)
from jaxtrain.data.sources import (DataError, JsonlSource, ParquetSource, TextFileSource,
                                   token_dtype)
from jaxtrain.data.tokenizer import Tokenizer, load_tokenizer

# read_manifest and worker_plan live beside the code they belong to; callers import them from here.
__all__ = ["FORMATS", "ON_BAD_RECORD", "main", "open_source", "prepare", "read_manifest",
           "worker_plan"]

FORMATS = ("text", "jsonl", "parquet")
ON_BAD_RECORD = ("fail", "skip")


def _human(n: float) -> str:
  """2100000 -> "2.1M": short counts for progress lines."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.1f}{unit}"
  return f"{n:.0f}"


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
  for path in source.local_paths:
    total += os.path.getsize(path)
    if total >= enough:
      break
  return total


# A forkserver child started from `python -m jaxtrain.data.prepare` re-runs this module as its
# `__mp_main__` (multiprocessing's spawn preparation), though the server preloaded it; runpy then
# warns that it is already imported. Harmless, and the filter, set at import in the server, is
# inherited by every worker forked from it.
warnings.filterwarnings("ignore", message=r"'jaxtrain\.data\.prepare' found in sys\.modules",
                        category=RuntimeWarning)


# --- the run ------------------------------------------------------------------------------------


def prepare(input, *, format: str, tokenizer: str | Tokenizer, output: str,
            field: str = "text", add_bos: bool = False, add_eos: bool = True,
            num_workers: int | None = None, docs_per_shard: int = 10000,
            on_bad_record: str = "fail", overwrite: bool = False,
            log: Callable[[str], None] | None = print) -> dict[str, Any]:
  """Tokenizes `input` into token-array shards under `output`; returns the manifest written.

  Args:
    input: a path, glob or list of them (see `resolve_paths`); s3:// and gs:// URLs too.
    format: "text" (one document per file), "jsonl" (`field` of each line) or "parquet" (column
      `field`).
    tokenizer: a `load_tokenizer` spec ("byte", "hf:PATH", "sentencepiece:PATH") or a Tokenizer.
    output: directory for the shards and `manifest.json`; created if missing. An s3:// or
      gs:// URL: the corpus is built in `storage.staging_path(output)` and uploaded to it when
      finished, `manifest.json` last; the staging copy is removed after.
    field: JSONL field or Parquet column holding the text.
    add_bos, add_eos: add BOS / EOS to every document (`Tokenizer.encode_document`).
    num_workers: tokenizing processes; None: one per CPU, or one for an input under 64 MiB (see
      `worker_plan`, also for the HF tokenizer's threads). Never more than there are shards.
      The output is the same for any number.
    docs_per_shard: documents per shard (the last shard holds the rest).
    on_bad_record: "fail" stops at the first bad record; "skip" leaves bad records out and
      counts them in the manifest's `skipped_records`.
    overwrite: replace a finished run in `output`; without it such a directory is refused. On
      a bucket the earlier run's objects are removed only when the new corpus is built.
    log: called with each progress line; None for silence.

  Raises:
    DataError: unusable input or output (no files, bad records, empty corpus, output taken).
    ConfigError: bad arguments or tokenizer.
  """
  log = log or (lambda _: None)
  start = time.perf_counter()
  _check_args(format, on_bad_record, num_workers, docs_per_shard)
  url = None
  if storage.is_url(os.fspath(output)):
    url = check_remote_output(os.fspath(output), overwrite)
    # The staging directory is this job's own: what an earlier job left there is replaced.
    output = check_output(storage.staging_path(url), overwrite=True)
  else:
    output = check_output(output, overwrite)
  try:
    manifest = _build(input, format=format, tokenizer=tokenizer, output=output,
                      shown=url or output, field=field, add_bos=add_bos, add_eos=add_eos,
                      num_workers=num_workers, docs_per_shard=docs_per_shard,
                      on_bad_record=on_bad_record, log=log)
    if url:
      publish(output, url, manifest, overwrite, log)
  finally:
    if url:
      # Built and uploaded, or failed: nothing in it is of use (a run starts afresh).
      remove_staging(output)

  totals = manifest["totals"]
  elapsed = time.perf_counter() - start
  tokens_per_sec = int(totals["tokens"] / max(elapsed, 1e-9))
  log(f"wrote {totals['documents']} documents, {_human(totals['tokens'])} tokens in "
      f"{totals['shards']} shards to {url or output} in {elapsed:.1f}s "
      f"({_human(tokens_per_sec)} tokens/s)")
  log(f"prepare: documents={totals['documents']} tokens={totals['tokens']} "
      f"shards={totals['shards']} tokens_per_sec={tokens_per_sec}")
  return manifest


def _build(input, *, format, tokenizer, output: str, shown: str, field, add_bos, add_eos,
           num_workers, docs_per_shard, on_bad_record, log) -> dict[str, Any]:
  """Tokenizes `input` into the local directory `output` (`shown` in log lines: the URL it is
  for); returns the manifest, written last."""
  tok = _load_tokenizer(tokenizer, add_bos, add_eos)
  tokenizer_spec = tok.name if isinstance(tokenizer, Tokenizer) else tokenizer
  dtype = token_dtype(tok.vocab_size)
  source = open_source(input, format, field, on_bad_record)
  # Only now, with input and tokenizer known good, is an earlier run's output removed.
  removed = clear_output(output)
  if removed and shown == output:  # a staging directory's leftovers are not the user's business
    log(f"removed {removed} files of an earlier run from {output}")

  num_shards = math.ceil(len(source) / docs_per_shard)
  workers, threads = worker_plan(tok, num_workers, num_shards,
                                 _input_bytes(source, SMALL_INPUT_BYTES))
  per_worker = (f" ({threads} tokenizer thread{'s' if threads > 1 else ''} each)"
                if tok.batch_threads else "")
  staged = f" (staged in {output})" if shown != output else ""
  log(f"prepare: {source.describe()} -> {num_shards} shards in {shown}{staged}, {workers} "
      f"workers{per_worker}, tokenizer {tok.name}, tokens as {dtype}")
  init_args = (source, tok, add_bos, add_eos, on_bad_record == "skip", output, docs_per_shard,
               num_shards, dtype)
  shards, skip_reasons = [], list(getattr(source, "skip_reasons", []))
  skipped = getattr(source, "skipped", 0)  # JSONL skips bad lines while indexing
  results = run_shards(init_args, num_shards, workers, threads)
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
    remove_temporaries(output)
    raise

  manifest = make_manifest(input=input, format=format, field=field, tok=tok,
                           tokenizer_spec=tokenizer_spec, dtype=dtype, add_bos=add_bos,
                           add_eos=add_eos, docs_per_shard=docs_per_shard,
                           on_bad_record=on_bad_record, shards=shards, skipped=skipped)
  totals = manifest["totals"]
  if totals["documents"] == 0:
    raise DataError(f"input {input!r}: empty corpus: all {skipped} records were bad and skipped, "
                    f"e.g. {skip_reasons[0] if skip_reasons else '?'}")
  write_manifest(output, manifest)
  if skipped:
    log(f"skipped {skipped} bad records, e.g.:")
    for reason in skip_reasons[:MAX_SKIP_REASONS]:
      log(f"  {reason}")
  return manifest


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
                 help="files or globs (quote globs), local or s3://BUCKET/... gs://BUCKET/... "
                      "URLs; several may follow --input")
  p.add_argument("--format", required=True, choices=FORMATS,
                 help="text: one document per file; jsonl: --field of each line; parquet: "
                      "column --field")
  p.add_argument("--field", default="text", help="JSONL field or Parquet column (default: text)")
  p.add_argument("--tokenizer", required=True,
                 help="byte | hf:PATH (tokenizer.json) | sentencepiece:PATH (.model)")
  p.add_argument("--output", required=True,
                 help="directory for the shards and manifest.json, or an s3:// or gs:// URL "
                      "(built locally, uploaded when finished)")
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
  # Run the importable module's `main`, not this `__main__` copy's: whatever it hands the worker
  # processes must pickle under an importable name, and a forkserver child has no `__main__.X`.
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()
  sys.exit(importlib.import_module("jaxtrain.data.prepare").main())
