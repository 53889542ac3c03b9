"""Data for the data-pipeline tests: a small data config, batch checks, resume checks, and
generated documents (JSONL files, a tiny BPE tokenizer). Shared by the test modules of
jaxtrain/data (tests import helpers from here or tests/helpers.py, never from each other)."""

import json
import os

import numpy as np

from jaxtrain import data
from jaxtrain.config import default_config
from jaxtrain.data import stdlib_corpus

T = 64


def small_config():
  c = default_config()
  c.train.seq_len = T
  c.train.global_batch_size = 4
  c.train.eval_batches = 2
  c.model.vocab_size = 384
  return c


def take(it, n):
  return [next(it) for _ in range(n)]


def source_config(source: str, train_paths, eval_fraction: float = 0.2):
  """small_config reading `train_paths` through `source`, its eval side held out."""
  c = small_config()
  c.data.source, c.data.train_paths, c.data.eval_fraction = source, train_paths, eval_fraction
  return c


def assert_reads_like(local, remote, source: str = "prepared", batches: int = 8):
  """The same corpus named two ways (a local path, a bucket URL) gives the same train batches
  and eval batches; with `source="prepared"`, the remote stream also resumes exactly."""
  here, there = source_config(source, local), source_config(source, remote)
  assert_batches_equal(take(data.make_train_iterator(here), batches),
                       take(data.make_train_iterator(there), batches))
  assert_batches_equal(data.make_eval_batches(here), data.make_eval_batches(there))
  if source == "prepared":
    assert_resumes(there)


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def check_batch(batch, rows):
  """Every structural invariant of the batch format, row by row."""
  assert set(batch) == set(data.BATCH_KEYS)
  dtypes = {"inputs": np.int32, "targets": np.int32, "loss_mask": np.float32,
            "segment_ids": np.int32, "positions": np.int32}
  for k, dtype in dtypes.items():
    assert batch[k].shape == (rows, T), k
    assert batch[k].dtype == dtype, k
  inputs, targets = batch["inputs"], batch["targets"]
  seg, pos, mask = batch["segment_ids"], batch["positions"], batch["loss_mask"]
  assert inputs.min() >= 0 and targets.max() <= stdlib_corpus.EOS_ID
  # EOS only ever ends a piece, so it is a target, never an input.
  assert not (inputs == stdlib_corpus.EOS_ID).any()
  np.testing.assert_array_equal(mask, (seg > 0).astype(np.float32))
  pad = seg == 0
  assert not inputs[pad].any() and not targets[pad].any() and not pos[pad].any()
  for r in range(rows):
    n_real = int((seg[r] > 0).sum())
    # First-fit packing leaves padding only at the end of a row.
    assert (seg[r, :n_real] > 0).all()
    ids = seg[r, :n_real]
    # Segments are contiguous and numbered 1, 2, 3, ... in order.
    np.testing.assert_array_equal(np.unique(ids), np.arange(1, ids.max() + 1) if n_real else [])
    assert (np.diff(ids) >= 0).all()
    for s in np.unique(ids):
      idx = np.flatnonzero(seg[r] == s)
      np.testing.assert_array_equal(pos[r, idx], np.arange(len(idx)))
      # Within a piece the targets are the inputs shifted by one.
      np.testing.assert_array_equal(inputs[r, idx[1:]], targets[r, idx[:-1]])


def assert_resumes(config, before=2, after=3):
  """`before` batches, save the state, `after` more; a new iterator restored from the state
  gives the same `after` batches."""
  it = data.make_train_iterator(config)
  take(it, before)
  # The state must survive JSON, which is how grain's Orbax handler stores it.
  state = json.loads(json.dumps(it.get_state()))
  expected = take(it, after)
  resumed = data.make_train_iterator(config)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, after), expected)



PROSE_WORDS = ("the a of and to in is was for on that with as by at from it an be this are or his "
         "which but not have had one all were they their has been more when who would will time "
         "river mountain language model token shard corpus training data window garden music "
         "über naïve café straße żółw 日本 данные δεδομένα").split()
def texts_jsonl(tmp_path, texts, name="corpus.jsonl"):
  """TMP_PATH/NAME: one {"text", "id"} record per text; its path."""
  path = tmp_path / name
  path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)),
                  encoding="utf-8")
  return path


def make_docs(n, seed=0):
  """English-like documents: sentences of random words, some non-ASCII, varied lengths."""
  rng = np.random.default_rng(seed)
  docs = []
  for _ in range(n):
    sentences = []
    for _ in range(int(rng.integers(1, 6))):
      words = rng.choice(PROSE_WORDS, size=int(rng.integers(3, 15)))
      sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    docs.append(rng.choice([" ", "\n"]).join(sentences))
  return docs


def write_jsonl(path, docs):
  with open(path, "w", encoding="utf-8") as f:
    for d in docs:
      f.write(json.dumps({"text": d, "id": len(d)}, ensure_ascii=False) + "\n")
  return str(path)


def train_bpe(directory, docs):
  """A tiny byte-level BPE tokenizer.json (vocab 300, "<s>"/"</s>") with a tokenizer_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(docs, trainer)
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "tokenizer.json")
  tok.save(path)
  with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
  return path




# Short words for small JSONL/text corpora.
GREEK_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def all_docs(src):
  """Every document of a source, in order."""
  return [src[i] for i in range(len(src))]
