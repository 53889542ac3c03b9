"""Throughput of `python -m jaxtrain.data.prepare` (read, tokenize, write shards), no model.

Corpus: the Python standard library's own .py files (no download; ~1800 files, ~31 MB on
CPython 3.11), written once to a temporary JSONL; `--max_docs` caps it to the first N files. A
byte-level BPE `tokenizer.json` (vocab `--vocab_size`, "<s>"/"</s>") is trained on the same files
in the temporary directory (~6 s on 2 cores for the whole corpus). `prepare` then runs for each
tokenizer (byte, bpe) with 1 and 2 worker processes and with the default (`num_workers=None`,
which `prepare.worker_plan` resolves: one process for an input this small); the table shows the
processes x tokenizer threads each ran with. Each time is the whole run as a user sees it,
worker start-up (~2.5 s) included. The corpus is cut into shards of `--docs_per_shard` documents
(default 100, ~18 shards) so that two workers have shards to share: with prepare's default of
10000 documents per shard the stdlib would be a single shard. Prints one table; the last line is
`prepare_throughput: byte_tokens_per_sec=N bpe_tokens_per_sec=N` (best worker setting of each).

The whole corpus takes about a minute on 2 cores (the BPE runs dominate); pass e.g.
`--max_docs 600` for a quicker look. Runs vary by ~20% on a shared machine: compare settings
within one run, not across runs.

  python benchmarks/prepare_throughput.py [--max_docs N] [--vocab_size 8000] [--docs_per_shard 100]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxtrain.data import prepare as prep
from jaxtrain.data import stdlib_corpus
from jaxtrain.data.tokenizer import load_tokenizer


def write_corpus(root: str, max_docs: int | None) -> tuple[str, list[str]]:
  """(JSONL path, texts) of the stdlib's .py files, the first `max_docs` in sorted order."""
  stdlib = stdlib_corpus.stdlib_root()
  texts = []
  for rel in stdlib_corpus.list_stdlib_files(stdlib)[:max_docs]:
    # A few test files are deliberately not UTF-8; replacing their bad bytes keeps them in.
    with open(os.path.join(stdlib, rel), encoding="utf-8", errors="replace") as f:
      texts.append(f.read())
  path = os.path.join(root, "corpus.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    for t in texts:
      f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
  return path, texts


def train_bpe(directory: str, texts: list[str], vocab_size: int) -> str:
  """Spec of a byte-level BPE trained on `texts`, with "<s>"/"</s>" named as BOS/EOS."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer)
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
  return "hf:" + os.path.join(directory, "tokenizer.json")


def measure(jsonl: str, tokenizer: str, num_workers: int | None, docs_per_shard: int,
            output: str) -> tuple[int, int, float]:
  """(documents, tokens, seconds) of one prepare run into `output`."""
  start = time.perf_counter()
  manifest = prep.prepare(jsonl, format="jsonl", tokenizer=tokenizer, output=output,
                          num_workers=num_workers, docs_per_shard=docs_per_shard,
                          overwrite=True, log=None)
  seconds = time.perf_counter() - start
  return manifest["totals"]["documents"], manifest["totals"]["tokens"], seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--max_docs", type=int, default=None,
                      help="use only the first N stdlib files (default: all)")
  parser.add_argument("--vocab_size", type=int, default=8000)
  parser.add_argument("--docs_per_shard", type=int, default=100)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as root:
    jsonl, texts = write_corpus(root, args.max_docs)
    specs = {"byte": "byte", "bpe": train_bpe(os.path.join(root, "bpe"), texts, args.vocab_size)}
    num_shards = -(-len(texts) // args.docs_per_shard)
    rows, best = [], {}
    for name, spec in specs.items():
      tok = load_tokenizer(spec)
      for workers in (1, 2, None):
        processes, threads = prep.worker_plan(tok, workers, num_shards,
                                               os.path.getsize(jsonl))
        setting = "default" if workers is None else str(workers)
        docs, tokens, seconds = measure(jsonl, spec, workers, args.docs_per_shard,
                                        os.path.join(root, "out"))
        rows.append((name, setting, processes, threads, docs, tokens, seconds))
        best[name] = max(best.get(name, 0.0), tokens / seconds)
  print(f"{'tokenizer':<9} {'workers':>8} {'procs x threads':>15} {'documents':>9} "
        f"{'tokens':>11} {'seconds':>8} {'tokens/s':>11}   ({num_shards} shards)")
  for name, setting, processes, threads, docs, tokens, seconds in rows:
    print(f"{name:<9} {setting:>8} {f'{processes} x {threads}':>15} {docs:>9,} {tokens:>11,} "
          f"{seconds:>8.2f} {tokens / seconds:>11,.0f}")
  print(f"prepare_throughput: byte_tokens_per_sec={best['byte']:.0f} "
        f"bpe_tokens_per_sec={best['bpe']:.0f}")


if __name__ == "__main__":
  # Worker processes re-import this file as their main module; only the parent runs the benchmark.
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()  # CPU only where there is no accelerator
  main()
