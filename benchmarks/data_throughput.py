"""Input pipeline throughput alone (read, tokenize, pack, batch), no model.

Corpus: the Python standard library's own .py files (no download), written once to a temporary
directory as JSONL (raw text, tokenized while reading) and as pre-tokenized ArrayRecord shards.
Batches of tiny.py's shape (16 × 256) are drawn with 0, 1 and 2 grain worker processes; the
first batch (worker start-up) is excluded from the timing. Prints one table; the last line is
`data_throughput: arrayrecord_tokens_per_sec=N jsonl_tokens_per_sec=N` (best worker count).

  python benchmarks/data_throughput.py [--seconds 5] [--tokenizer byte|hf:PATH/tokenizer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from jaxtrain import data
from jaxtrain.config import default_config
from jaxtrain.data import sources, stdlib_corpus
from jaxtrain.data.tokenizer import load_tokenizer


def write_corpus(root: str, tokenizer_spec: str, max_docs: int) -> tuple[str, str]:
  """(jsonl path, arrayrecord glob) of the stdlib's .py files."""
  stdlib = stdlib_corpus.stdlib_root()
  texts = []
  for rel in stdlib_corpus.list_stdlib_files(stdlib)[:max_docs]:
    with open(os.path.join(stdlib, rel), encoding="utf-8", errors="replace") as f:
      texts.append(f.read())
  jsonl = os.path.join(root, "corpus.jsonl")
  with open(jsonl, "w", encoding="utf-8") as f:
    for t in texts:
      f.write(json.dumps({"text": t}) + "\n")
  tok = load_tokenizer(tokenizer_spec)
  half = len(texts) // 2
  for i, part in enumerate((texts[:half], texts[half:])):
    sources.write_array_record_shard(
        os.path.join(root, f"shard-{i}.arrayrecord"),
        (tok.encode_document(t, add_bos=False, add_eos=True) for t in part))
  return jsonl, os.path.join(root, "*.arrayrecord")


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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=5.0)
  parser.add_argument("--tokenizer", default="byte")
  parser.add_argument("--max_docs", type=int, default=400)
  args = parser.parse_args()
  tok = load_tokenizer(args.tokenizer)
  with tempfile.TemporaryDirectory() as root:
    jsonl, shards = write_corpus(root, args.tokenizer, args.max_docs)
    rows, best = [], {}
    for name, source, paths in [("arrayrecord", "arrayrecord", shards),
                                ("jsonl", "jsonl", jsonl)]:
      for workers in (0, 1, 2):
        c = default_config()
        c.model.vocab_size = max(384, tok.vocab_size)
        c.train.global_batch_size, c.train.seq_len = 16, 256
        c.data.source, c.data.train_paths, c.data.tokenizer = source, paths, args.tokenizer
        c.data.num_workers = workers
        rate = measure(c, args.seconds)
        rows.append((name, workers, rate))
        best[name] = max(best.get(name, 0.0), rate)
  print(f"{'source':<12} {'workers':>7} {'tokens/s':>14}   (batches of 16 × 256, "
        f"tokenizer {tok.name})")
  for name, workers, rate in rows:
    print(f"{name:<12} {workers:>7} {rate:>14,.0f}")
  print(f"data_throughput: arrayrecord_tokens_per_sec={best['arrayrecord']:.0f} "
        f"jsonl_tokens_per_sec={best['jsonl']:.0f}")


if __name__ == "__main__":
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()  # CPU only where there is no accelerator
  main()
