"""Input pipeline throughput alone (read, tokenize, pack, batch), no model.

Corpus: the Python standard library's own .py files (no download), written once to a temporary
directory as JSONL (raw text, tokenized while reading) and as a prepared corpus
(`python -m jaxtrain.data.prepare`: flat token shards read by slice as one global stream).
Batches of tiny.py's shape (16 × 256) are drawn from the prepared corpus (in-process: the global
stream has no workers) and from the JSONL with 0, 1 and 2 grain worker processes; the prepared
corpus also at longer sequences (16 × 8192). The first batch (start-up) is excluded from the
timing. With the dev extra installed (moto's S3 server, s3fs), the prepared corpus is also
uploaded to a bucket of an S3 server started on the loopback interface and read from there
(`prepared-s3`: 256 KiB blocks by ranged reads, fetched ahead of the reader, in a 256 MiB cache,
jaxtrain/data/sources/remote_tokens.py; `s3-cold`: the same with a 4 MiB cache, so that most
batches come from the server, as for a corpus far larger than the cache); --no_s3 skips both.
Prints one table; with --profile, where the prepared path's time goes. The last line is
`data_throughput: arrayrecord_tokens_per_sec=N jsonl_tokens_per_sec=N` (16 × 256; the first
figure is the prepared-corpus path, whatever its file format; JSONL at its best worker count).

  python benchmarks/data_throughput.py [--seconds 5] [--tokenizer byte|hf:PATH/tokenizer.json]
                                       [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import json
import os
import pstats
import sys
import tempfile
import time
from unittest import mock

from jaxtrain import data
from jaxtrain.config import default_config
from jaxtrain.data import documents, stdlib_corpus
from jaxtrain.data.prepare import prepare
from jaxtrain.data.sources import remote_tokens
from jaxtrain.data.tokenizer import load_tokenizer


def write_corpus(root: str, tokenizer_spec: str, max_docs: int) -> tuple[str, str]:
  """(jsonl path, prepared directory) of the stdlib's .py files."""
  stdlib = stdlib_corpus.stdlib_root()
  jsonl = os.path.join(root, "corpus.jsonl")
  with open(jsonl, "w", encoding="utf-8") as out:
    for rel in stdlib_corpus.list_stdlib_files(stdlib)[:max_docs]:
      with open(os.path.join(stdlib, rel), encoding="utf-8", errors="replace") as f:
        out.write(json.dumps({"text": f.read()}) + "\n")
  prepared = os.path.join(root, "prepared")
  prepare(jsonl, format="jsonl", tokenizer=tokenizer_spec, output=prepared, num_workers=1,
          docs_per_shard=max(max_docs // 4, 1), log=None)
  return jsonl, prepared


def _config(source: str, paths: str, tokenizer_spec: str, vocab_size: int, seq_len: int,
            workers: int):
  c = default_config()
  c.model.vocab_size = max(384, vocab_size)
  c.train.global_batch_size, c.train.seq_len = 16, seq_len
  c.data.source, c.data.train_paths, c.data.tokenizer = source, paths, tokenizer_spec
  c.data.num_workers = workers
  return c


def _upload_to_local_s3(prepared: str, stack: contextlib.ExitStack) -> str | None:
  """s3://BUCKET/prepared on an S3 server of our own (tests/object_store.py), or None (with the
  reason) where the dev extra's moto and s3fs are not installed."""
  missing = [m for m in ("moto", "s3fs") if importlib.util.find_spec(m) is None]
  if missing:
    print(f"prepared-s3 skipped: {', '.join(missing)} not installed (pip install -e '.[dev]')")
    return None
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from tests.object_store import s3_server, upload  # pylint: disable=import-outside-toplevel
  _, bucket = stack.enter_context(s3_server())
  url = f"s3://{bucket}/prepared"
  upload(prepared, url)
  return url


def measure(config, seconds: float) -> float:
  """Tokens per second (B × T per batch) after the first batch."""
  it = data.make_train_iterator(config)
  next(it)
  tokens_per_batch = config.train.global_batch_size * config.train.seq_len
  start, batches = time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    next(it)
    batches += 1
  rate = batches * tokens_per_batch / (time.perf_counter() - start)
  if hasattr(it, "close"):
    it.close()
  return rate


def profile(config, batches: int = 4000) -> None:
  """Where the prepared path's time goes: the stream's own functions by total time."""
  it = data.make_train_iterator(config)
  next(it)
  profiler = cProfile.Profile()
  profiler.enable()
  for _ in range(batches):
    next(it)
  profiler.disable()
  stats = pstats.Stats(profiler)
  total = sum(v[2] for v in stats.stats.values())  # tottime over every function
  rows = sorted(((v[2], f"{os.path.basename(k[0])}:{k[2]}") for k, v in stats.stats.items()),
                reverse=True)[:12]
  print(f"profile: {batches} batches of 16 × {config.train.seq_len}, "
        f"{total / batches * 1e6:.0f} us per batch under the profiler")
  for seconds, name in rows:
    print(f"  {100 * seconds / total:5.1f}%  {seconds / batches * 1e6:7.1f} us  {name}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=5.0)
  parser.add_argument("--tokenizer", default="byte")
  parser.add_argument("--max_docs", type=int, default=400)
  parser.add_argument("--profile", action="store_true",
                      help="also profile the prepared path (16 × 256)")
  parser.add_argument("--no_s3", action="store_true",
                      help="skip the prepared corpus read from a local S3 server")
  args = parser.parse_args()
  tok = load_tokenizer(args.tokenizer)
  with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
    jsonl, prepared = write_corpus(root, args.tokenizer, args.max_docs)
    runs = [("prepared", prepared, 256, 0), ("prepared", prepared, 8192, 0)]
    runs += [("jsonl", jsonl, 256, w) for w in (0, 1, 2)]
    url = None if args.no_s3 else _upload_to_local_s3(prepared, stack)
    if url:
      runs += [("prepared-s3", url, 256, 0), ("s3-cold", url, 256, 0)]
    rows, best = [], {}
    for source, paths, seq_len, workers in runs:
      kind = "prepared" if source.startswith(("prepared", "s3")) else source
      c = _config(kind, paths, args.tokenizer, tok.vocab_size, seq_len, workers)
      # s3-cold: a block cache of 4 MiB, which holds less than half of this 10 MB corpus, so
      # most batches are fetched from the server, as for a real corpus far larger than the
      # default 256 MiB (which holds this one whole after its first pass).
      documents._load_cached.cache_clear()  # a fresh corpus object: an empty cache
      with mock.patch.object(remote_tokens, "CACHE_BYTES",
                             4 << 20 if source == "s3-cold" else remote_tokens.CACHE_BYTES):
        rate = measure(c, args.seconds)
      rows.append((source, seq_len, workers, rate))
      if seq_len == 256:
        best[source] = max(best.get(source, 0.0), rate)
    if args.profile:
      profile(_config("prepared", prepared, args.tokenizer, tok.vocab_size, 256, 0))
  print(f"{'source':<12} {'batch':>9} {'workers':>8} {'tokens/s':>14}   (tokenizer {tok.name})")
  for source, seq_len, workers, rate in rows:
    workers_text = str(workers) if source == "jsonl" else "-"
    print(f"{source:<12} {'16 × ' + str(seq_len):>9} {workers_text:>8} {rate:>14,.0f}")
  print(f"data_throughput: arrayrecord_tokens_per_sec={best['prepared']:.0f} "
        f"jsonl_tokens_per_sec={best['jsonl']:.0f}")


if __name__ == "__main__":
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()  # CPU only where there is no accelerator
  main()
