"""JSONL random access (jaxtrain.data.sources.JsonlSource): the newline index and random reads.

A JSONL file of identical records (~1 KB each, non-ASCII text; `--size_mb`, default 50) is written
once to a temporary directory, then timed: the newline scan that indexes it
(`nonblank_line_starts`) at each read size of `--chunk_kib` (jsonl.py's _INDEX_CHUNK_BYTES, 1 MiB,
is the default the sources use), the whole JsonlSource construction, and `--reads` reads of random
documents. Each time is the best of `--repeats`; the file stays in the page cache, so these are
the CPU's rates, not the disk's. Prints one table; the last line is
`jsonl_index: index_mb_per_sec=N build_mb_per_sec=N reads_per_sec=N` (the index at the default
read size).

  python benchmarks/jsonl_index.py [--size_mb 50] [--reads 20000] [--chunk_kib 128,1024,8192]
                                   [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from jaxtrain.data import sources
from jaxtrain.data.sources import jsonl

TEXT = "ein Beispieltext äöü " * 20


def write_file(path: str, size_mb: float) -> int:
  """Writes `size_mb` MB of one repeated record to `path`; returns the number of lines."""
  line = (json.dumps({"text": TEXT, "id": 123}, ensure_ascii=False) + "\n").encode()
  lines = int(size_mb * 2**20) // len(line)
  with open(path, "wb") as f:
    f.write(line * lines)
  return lines


def best_of(repeats: int, fn):
  """(fastest seconds, last result) of `repeats` calls of fn()."""
  best, result = float("inf"), None
  for _ in range(repeats):
    start = time.perf_counter()
    result = fn()
    best = min(best, time.perf_counter() - start)
  return best, result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size_mb", type=float, default=50.0)
  parser.add_argument("--reads", type=int, default=20000)
  parser.add_argument("--chunk_kib", default="128,1024,8192",
                      help="read sizes of the newline scan, KiB, comma-separated")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  default_kib = jsonl._INDEX_CHUNK_BYTES // 1024  # pylint: disable=protected-access
  chunks = sorted({int(k) for k in args.chunk_kib.split(",")} | {default_kib})
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "big.jsonl")
    lines = write_file(path, args.size_mb)
    size_mb = os.path.getsize(path) / 1e6
    rows = []
    for kib in chunks:
      seconds, starts = best_of(args.repeats,
                                lambda kib=kib: sources.nonblank_line_starts(path, kib * 1024))
      if len(starts) != lines:
        raise RuntimeError(f"the index found {len(starts)} lines of {lines} at {kib} KiB reads")
      rows.append((f"index, {kib} KiB reads" + (" (default)" if kib == default_kib else ""),
                   seconds, size_mb / seconds, "MB/s"))
      if kib == default_kib:
        index_rate = size_mb / seconds
    build_s, src = best_of(args.repeats, lambda: sources.JsonlSource(path))
    rows.append(("JsonlSource construction", build_s, size_mb / build_s, "MB/s"))
    order = np.random.default_rng(0).integers(0, len(src), args.reads)
    read_s, docs = best_of(args.repeats, lambda: [src[i] for i in order])
    if docs[0] != TEXT or docs[-1] != TEXT:
      raise RuntimeError("a random read returned another text than the file's")
    rows.append((f"{args.reads} random reads", read_s, args.reads / read_s, "docs/s"))
  print(f"JSONL file: {size_mb:.0f} MB, {lines:,} lines; best of {args.repeats}")
  print(f"{'what':<32} {'seconds':>9} {'rate':>12}")
  for what, seconds, rate, unit in rows:
    print(f"{what:<32} {seconds:>9.3f} {rate:>12,.0f} {unit}")
  print(f"jsonl_index: index_mb_per_sec={index_rate:.0f} build_mb_per_sec={size_mb / build_s:.0f} "
        f"reads_per_sec={args.reads / read_s:.0f}")


if __name__ == "__main__":
  main()
