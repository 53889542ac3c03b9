"""Training batches from raw text sources tokenized while reading (text, jsonl, parquet)."""

import json

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.config import ConfigError
from jaxtrain.data import sources
from tests.helpers import SMALL_TINY_ARGS as SMALL, run_cli, run_main
from tests.data_helpers import GREEK_WORDS as WORDS, texts_jsonl
from tests.data_helpers import T, assert_batches_equal, assert_resumes, small_config, take




def _texts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, int(rng.integers(5, 80)))) + " é" for _ in range(n)]


def _config(path, **data_overrides):
  c = small_config()
  c.data.source = "jsonl"
  c.data.train_paths = str(path)
  c.data.eval_fraction = 0.2
  for k, v in data_overrides.items():
    c.data[k] = v
  return c


def _check_text_batch(batch, rows):
  for k in data.BATCH_KEYS:
    assert batch[k].shape == (rows, T)
  seg, pos = batch["segment_ids"], batch["positions"]
  np.testing.assert_array_equal(batch["loss_mask"], (seg > 0).astype(np.float32))
  for r in range(rows):
    for s in np.unique(seg[r][seg[r] > 0]):
      idx = np.flatnonzero(seg[r] == s)
      np.testing.assert_array_equal(pos[r, idx], np.arange(len(idx)))
      np.testing.assert_array_equal(batch["inputs"][r, idx[1:]], batch["targets"][r, idx[:-1]])


def test_jsonl_bytes_batches_are_slices_of_the_documents(tmp_path):
  texts = _texts(200)
  c = _config(texts_jsonl(tmp_path, texts))
  batches = take(data.make_train_iterator(c), 3)
  for b in batches:
    _check_text_batch(b, rows=4)
  corpus = "\n".join(texts).encode("utf-8")
  seg = batches[0]["segment_ids"][0]
  idx = np.flatnonzero(seg == 1)
  piece = np.append(batches[0]["inputs"][0, idx], batches[0]["targets"][0, idx[-1]])
  body = piece[piece < 256].astype(np.uint8).tobytes()  # EOS (256) ends a document
  assert body in corpus
  train, evals = data.load_sources(c)
  assert len(train) + len(evals) == 200 and len(evals) > 10
  assert_batches_equal(data.make_eval_batches(c), data.make_eval_batches(c))


def test_long_documents_are_split_into_pieces(tmp_path):
  texts = ["word " * 100] * 20  # 500 bytes each, many times seq_len
  batch = next(data.make_train_iterator(_config(texts_jsonl(tmp_path, texts))))
  assert (batch["segment_ids"] > 0).all()  # long pieces fill whole rows


def test_resume_from_state(tmp_path):
  assert_resumes(_config(texts_jsonl(tmp_path, _texts(100))))


def test_text_files_and_parquet(tmp_path):
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  texts = _texts(60)
  (tmp_path / "txt").mkdir()
  for i, t in enumerate(texts):
    (tmp_path / "txt" / f"{i:03d}.txt").write_text(t, encoding="utf-8")
  pq.write_table(pa.table({"body": texts}), tmp_path / "c.parquet")
  for source, paths, extra in [("text", tmp_path / "txt" / "*.txt", {}),
                               ("parquet", tmp_path / "c.parquet", {"field": "body"})]:
    c = _config(paths, source=source, **extra)
    _check_text_batch(next(data.make_train_iterator(c)), rows=4)


def test_model_vocab_smaller_than_tokenizer(tmp_path):
  c = _config(texts_jsonl(tmp_path, _texts(20)))
  c.model.vocab_size = 257  # the byte tokenizer emits 258 ids (BOS is 257)
  with pytest.raises(ConfigError, match=r"model.vocab_size=257.*258"):
    data.make_train_iterator(c)


def test_missing_field_names_file_and_line(tmp_path):
  path = texts_jsonl(tmp_path, _texts(1))
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps({"body": "no text field"}) + "\n")
  c = _config(path, eval_paths=str(path))
  # Two documents repeat until the first batch is full, so the bad one is read.
  with pytest.raises(sources.DataError, match=r"corpus.jsonl:2.*'text'"):
    next(data.make_train_iterator(c))


@pytest.mark.slow
def test_cli_malformed_jsonl_exits_2_naming_the_line(tmp_path):
  path = texts_jsonl(tmp_path, _texts(3))
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"text": "unterminated\n')
  data_flags = ["--config=configs/tiny.py", "--config.data.source=jsonl",
                f"--config.data.train_paths={path}", f"--config.data.eval_paths={path}",
                *SMALL, "--config.train.eval_batches=1", "--config.train.steps=1"]
  # The default (data.on_bad_record='fail'): the run stops before training, exit code 2 and one
  # line naming the file and the line. A real process: the suite's exit-code check of a data
  # error through `python -m jaxtrain.main`.
  proc = run_main(*data_flags, f"--workdir={tmp_path / 'fail'}", devices=1, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith("data error: ") and f"{path}:4" in lines[0], lines
  assert "malformed JSON" in lines[0] and "on_bad_record='skip'" in lines[0], lines
  assert not (tmp_path / "fail" / "checkpoints").exists()
  # With skip the bad line is dropped and counted; the run trains.
  proc = run_cli(*data_flags, f"--workdir={tmp_path / 'run'}", "--config.data.on_bad_record=skip")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "1 skipped" in proc.stdout, proc.stdout[-2000:]
  proc = run_cli("--config=configs/tiny.py", f"--workdir={tmp_path / 'run2'}",
                 "--config.data.source=jsonl",
                 f"--config.data.train_paths={tmp_path / 'nothing*.jsonl'}",
                 "--config.train.steps=1")
  assert proc.returncode == 2
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and "no files match" in lines[0], proc.stderr[-2000:]


def test_prompt_completion_loss_only_on_completions(tmp_path):
  path = tmp_path / "sft.jsonl"
  records = [{"prompt": f"Q{i}: what is {i}+{i}? ", "completion": f"It is {2 * i}."}
             for i in range(40)]
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  c = _config(path, format="prompt_completion")
  batch = next(data.make_train_iterator(c))
  mask, targets = batch["loss_mask"], batch["targets"]
  assert 0 < mask.sum() < (batch["segment_ids"] > 0).sum()
  trained = bytes(int(t) for t in targets[mask > 0] if t < 256).decode("utf-8")
  assert "It is" in trained and "what is" not in trained


def test_chat_loss_only_on_assistant_turns(tmp_path):
  path = tmp_path / "chat.jsonl"
  records = [{"messages": [{"role": "user", "content": f"ping {i}"},
                           {"role": "assistant", "content": f"pong {i}"}]} for i in range(40)]
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  c = _config(path, format="chat")
  batch = next(data.make_train_iterator(c))
  trained = bytes(int(t) for t in batch["targets"][batch["loss_mask"] > 0] if t < 256)
  assert b"pong" in trained and b"ping" not in trained


def test_fine_tuning_formats_needtexts_jsonl(tmp_path):
  c = _config(tmp_path / "x.txt", source="text", format="chat")
  with pytest.raises(ConfigError, match="data.format='chat'.*jsonl"):
    data.make_train_iterator(c)
