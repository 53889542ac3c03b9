"""Preference pairs -> padded DPO rows: masks at the response's own positions, exact resume."""

import json

import numpy as np
import pytest

from jaxtrain.data.preference import PreferenceRows, RecordSubset, preference_dataset
from jaxtrain.data.sources import DataError, JsonlSource
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.objectives.dpo.loss import BATCH_KEYS

TOK = load_tokenizer("byte")
RECORDS = [{"prompt": f"Q{i}: 2+2?", "chosen": " 4", "rejected": " five" * (i % 3 + 1)}
           for i in range(10)]


def _iterator(records=RECORDS, seq_len=24):
  return iter(preference_dataset(records, TOK, seq_len=seq_len, batch_size=4,
                                 vocab_size=TOK.vocab_size, seed=0))


def test_rows_hold_prompt_and_response_with_the_loss_on_the_response():
  batch = next(_iterator())
  assert sorted(batch) == sorted(BATCH_KEYS)
  assert all(v.shape == (4, 25) for v in batch.values())
  for b in range(4):
    ids, attention = batch["chosen_input_ids"][b], batch["chosen_attention_mask"][b]
    loss = batch["chosen_loss_mask"][b]
    n = int(attention.sum())
    assert ids[0] == TOK.bos_id and ids[n - 1] == TOK.eos_id and not ids[n:].any()
    trained = bytes(int(i) for i in ids[loss > 0] if i < 256)
    assert trained == b" 4" and loss[n - 1] == 1.0  # the response and its EOS
    prompt = bytes(int(i) for i in ids[1:n] if i < 256)[:-2].decode()
    assert prompt.startswith("Q") and prompt.endswith("2+2?")


def test_pairs_cut_before_their_response_are_skipped():
  records = [{"prompt": "x" * 40, "chosen": "a", "rejected": "b"}] + RECORDS
  it = _iterator(records)
  for _ in range(5):
    batch = next(it)
    assert (batch["chosen_loss_mask"].sum(axis=1) > 0).all()
    assert (batch["rejected_loss_mask"].sum(axis=1) > 0).all()


def test_iterator_state_restores_exactly():
  it = _iterator()
  next(it)
  state = it.get_state()
  want = next(it)
  it.set_state(state)
  got = next(it)
  for key in BATCH_KEYS:
    np.testing.assert_array_equal(got[key], want[key])


def test_a_bad_record_of_a_held_out_split_is_named_by_its_file_and_line(tmp_path):
  path = tmp_path / "pairs.jsonl"
  good = {"prompt": "reverse: ab\n", "chosen": "ba", "rejected": "ab"}
  lines = [good] * 5 + [{"prompt": "reverse: cd\n", "chosen": "dc"}] + [good] * 2
  path.write_text("\n".join(json.dumps(r) for r in lines) + "\n", encoding="utf-8")
  source = JsonlSource(str(path), field=None)
  # The subset's record 1 is the file's record 5, on line 6.
  rows = PreferenceRows(RecordSubset(source, np.array([2, 5, 7])), load_tokenizer("byte"),
                        length=16, vocab_size=384)
  assert rows(0) is not None
  with pytest.raises(DataError, match=rf"^{path}:6: preference record: missing key 'rejected'"):
    rows(1)
