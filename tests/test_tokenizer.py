"""Tests for the tokenizer interface: byte, Hugging Face and SentencePiece kinds (no downloads).

The HF and SentencePiece tokenizers are trained here on a few hundred generated sentences, which
takes well under a second each.
"""

import json
import os
import pickle

import numpy as np
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.data import stdlib_corpus
from jaxtrain.data import tokenizer as tokenizer_lib

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "jovial packing boxes of liquor and zebras graze near the river bank").split()
SENTENCES = [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 8 + i % 5)) + "."
             for i in range(300)]
TEXT = "the lazy dog jumps over seven boxes."

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                 "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def train_hf_tokenizer(directory, tokenizer_config=None):
  """A byte-level BPE with <s>/</s> specials and a post-processor that would add them."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "[UNK]"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(SENTENCES, trainer=trainer)
  # encode(add_special_tokens=True) would wrap every text in <s> ... </s>; ours must not.
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")),
                                            ("</s>", tok.token_to_id("</s>"))])
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  if tokenizer_config is not None:
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump(tokenizer_config, f)
  return os.path.join(directory, "tokenizer.json")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tokenizer.json with a tokenizer_config.json naming BOS (as a dict), EOS and a template."""
  d = str(tmp_path_factory.mktemp("hf"))
  train_hf_tokenizer(d, {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
                         "chat_template": CHAT_TEMPLATE})
  return d


@pytest.fixture(scope="module")
def hf_bare_dir(tmp_path_factory):
  """A tokenizer.json alone: specials come from the vocab lookup, no chat template."""
  d = str(tmp_path_factory.mktemp("hf_bare"))
  train_hf_tokenizer(d)
  return d


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
  """A SentencePiece BPE with non-default special ids, so the test sees they come from the model."""
  import sentencepiece as spm

  prefix = os.path.join(str(tmp_path_factory.mktemp("sp")), "sp")
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(SENTENCES), model_prefix=prefix, vocab_size=100, model_type="bpe",
      character_coverage=1.0, normalization_rule_name="identity", pad_id=0, unk_id=1,
      bos_id=2, eos_id=3, minloglevel=2)
  return prefix + ".model"


# --- Byte ---------------------------------------------------------------------------------------


def test_byte_round_trip_and_specials():
  tok = tokenizer_lib.load_tokenizer("byte")
  assert isinstance(tok, tokenizer_lib.ByteTokenizer)
  text = "héllo wörld — 你好 🙂"
  ids = tok.encode(text)
  assert ids.dtype == np.int32
  assert len(ids) == len(text.encode("utf-8"))
  assert ids.max() < 256
  assert tok.decode(ids) == text
  assert tok.eos_id == stdlib_corpus.EOS_ID == 256
  assert (tok.bos_id, tok.pad_id, tok.vocab_size) == (257, None, 258)
  doc = tok.encode_document(text, add_bos=True, add_eos=True)
  assert doc[0] == 257 and doc[-1] == 256 and doc.max() < 258
  np.testing.assert_array_equal(doc[1:-1], ids)
  # Specials and ids past the tokenizer's vocab (a padded model vocab) decode to nothing.
  assert tok.decode(np.concatenate([[257], ids, [256, 300]])) == text


# --- Hugging Face -------------------------------------------------------------------------------


def test_hf_round_trip_and_specials_from_config(hf_dir):
  tok = tokenizer_lib.load_tokenizer("hf:" + hf_dir)
  assert isinstance(tok, tokenizer_lib.HFTokenizer)
  assert tok.name == "hf:" + os.path.join(hf_dir, "tokenizer.json")
  assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True) == 300
  assert tok.bos_id == tok._tok.token_to_id("<s>")
  assert tok.eos_id == tok._tok.token_to_id("</s>")
  assert (tok.bos_token, tok.eos_token, tok.pad_id) == ("<s>", "</s>", None)
  assert tok.chat_template == CHAT_TEMPLATE

  for text in (TEXT, "unseen wörds: ∑ 你好!"):  # byte-level BPE round-trips any text
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert tok.decode(ids) == text
  ids = tok.encode(TEXT)
  assert len(ids) < len(TEXT)  # merges were learned
  # The post-processor would add <s> ... </s>; encode must not.
  assert tok._tok.encode(TEXT).ids[0] == tok.bos_id
  assert tok.bos_id not in ids and tok.eos_id not in ids

  for add_bos in (False, True):
    for add_eos in (False, True):
      doc = tok.encode_document(TEXT, add_bos=add_bos, add_eos=add_eos)
      want = [tok.bos_id] * add_bos + ids.tolist() + [tok.eos_id] * add_eos
      assert doc.tolist() == want and doc.dtype == np.int32
  assert tok.decode(tok.encode_document(TEXT, add_bos=True, add_eos=True)) == TEXT


def test_hf_specials_from_vocab_and_path_forms(hf_bare_dir):
  path = os.path.join(hf_bare_dir, "tokenizer.json")
  for spec in (path, hf_bare_dir, "hf:" + path):
    tok = tokenizer_lib.load_tokenizer(spec)
    assert tok.name == "hf:" + path
    assert tok.bos_id == tok._tok.token_to_id("<s>")
    assert tok.eos_id == tok._tok.token_to_id("</s>")
    assert tok.chat_template is None


def test_hf_config_token_not_in_vocab(tmp_path):
  train_hf_tokenizer(str(tmp_path), {"eos_token": "<|end_of_text|>"})
  with pytest.raises(ConfigError, match=r"eos_token='<\|end_of_text\|>'.*not in the vocabulary"):
    tokenizer_lib.load_tokenizer(str(tmp_path))


def test_hf_null_bos_in_config_means_none(tmp_path):
  train_hf_tokenizer(str(tmp_path), {"bos_token": None, "eos_token": "</s>"})
  tok = tokenizer_lib.load_tokenizer(str(tmp_path))
  assert tok.bos_id is None and tok.eos_id is not None
  with pytest.raises(ConfigError, match="add_bos=True: tokenizer hf:.* has no BOS token"):
    tok.encode_document(TEXT, add_bos=True, add_eos=True)


# --- SentencePiece ------------------------------------------------------------------------------


def test_sentencepiece_round_trip_and_specials(sp_model):
  for spec in (sp_model, "sentencepiece:" + sp_model):
    tok = tokenizer_lib.load_tokenizer(spec)
    assert isinstance(tok, tokenizer_lib.SentencePieceTokenizer)
    assert tok.name == "sentencepiece:" + sp_model
  assert tok.vocab_size == 100
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
  assert tok.chat_template is None
  ids = tok.encode(TEXT)
  assert ids.dtype == np.int32 and len(ids) < len(TEXT)
  assert not {0, 2, 3} & set(ids.tolist())
  assert tok.decode(ids) == TEXT
  doc = tok.encode_document(TEXT, add_bos=True, add_eos=True)
  assert doc.tolist() == [2] + ids.tolist() + [3]
  assert tok.decode(doc) == TEXT
  assert tok.encode_document(TEXT, add_bos=False, add_eos=False).tolist() == ids.tolist()


def test_sentencepiece_without_specials_reports_none(tmp_path):
  import sentencepiece as spm

  prefix = str(tmp_path / "nospecial")
  spm.SentencePieceTrainer.train(sentence_iterator=iter(SENTENCES), model_prefix=prefix,
                                 vocab_size=50, model_type="unigram", hard_vocab_limit=False,
                                 bos_id=-1, eos_id=-1, minloglevel=2)
  tok = tokenizer_lib.load_tokenizer(prefix + ".model")
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, None, None)
  with pytest.raises(ConfigError, match="add_eos=True.*has no EOS token"):
    tok.encode_document(TEXT, add_bos=False, add_eos=True)


def test_directory_with_tokenizer_model(tmp_path, sp_model):
  os.symlink(sp_model, tmp_path / "tokenizer.model")
  tok = tokenizer_lib.load_tokenizer(str(tmp_path))
  assert isinstance(tok, tokenizer_lib.SentencePieceTokenizer)


# --- Batches ------------------------------------------------------------------------------------

# Empty, whitespace-only, non-ASCII (2-, 3- and 4-byte UTF-8), specials written in the text (HF
# parses those into their ids, in a batch too), a long text, and texts of the training kind.
BATCH_TEXTS = (["", TEXT, "unseen wörds: ∑ 你好! 🙂", "   ", "\n\n\t", "é", "<s> tags </s> inline",
                " leading space", "trailing newline\n", "zebras graze " * 300]
               + SENTENCES[:40])


def assert_batch_matches_documents(tok, texts):
  """encode_documents == encode_document text by text, for every BOS/EOS combination."""
  for add_bos in (False, True):
    for add_eos in (False, True):
      docs = tok.encode_documents(texts, add_bos=add_bos, add_eos=add_eos)
      assert isinstance(docs, list) and len(docs) == len(texts)
      for text, doc in zip(texts, docs):
        want = tok.encode_document(text, add_bos=add_bos, add_eos=add_eos)
        assert doc.dtype == np.int32 and doc.shape == want.shape, text
        np.testing.assert_array_equal(doc, want, err_msg=repr(text[:40]))
  assert tok.encode_documents([], add_bos=False, add_eos=True) == []


def test_encode_documents_byte():
  tok = tokenizer_lib.load_tokenizer("byte")
  assert not tok.batch_threads
  assert_batch_matches_documents(tok, BATCH_TEXTS)


def test_encode_documents_hf(hf_dir):
  tok = tokenizer_lib.load_tokenizer(hf_dir)
  assert tok.batch_threads
  # The post-processor would wrap each text in <s> ... </s>, and the text "<s>" encodes to the BOS
  # id: the batch must take neither path differently from encode_document.
  assert tok._tok.encode(TEXT).ids[0] == tok.bos_id
  assert tok.encode("<s>").tolist() == [tok.bos_id]
  assert_batch_matches_documents(tok, BATCH_TEXTS)
  assert_batch_matches_documents(tok, BATCH_TEXTS[::-1])  # no dependence on the neighbours


def test_encode_documents_hf_with_padding_configured(hf_dir):
  """A tokenizer.json that enables padding pads a batch to its longest text; the documents must
  still be those of encode_document (which pads a text to its own length: not at all)."""
  tok = tokenizer_lib.load_tokenizer(hf_dir)
  tok._tok.enable_padding(pad_id=tok.eos_id, pad_token="</s>")
  padded = tok._tok.encode_batch(BATCH_TEXTS, add_special_tokens=False)
  assert len({len(e.ids) for e in padded}) == 1  # what the library does to a batch
  assert_batch_matches_documents(tok, BATCH_TEXTS)


def test_encode_documents_hf_missing_special(tmp_path):
  train_hf_tokenizer(str(tmp_path), {"bos_token": None, "eos_token": "</s>"})
  tok = tokenizer_lib.load_tokenizer(str(tmp_path))
  with pytest.raises(ConfigError, match="add_bos=True: tokenizer hf:.* has no BOS token"):
    tok.encode_documents([TEXT], add_bos=True, add_eos=True)


@pytest.mark.parametrize("value, threads", [(None, True), ("true", True), ("1", True),
                                            ("false", False), ("0", False), ("OFF", False),
                                            ("", False)])
def test_hf_batch_threads_follow_tokenizers_parallelism(hf_dir, monkeypatch, value, threads):
  """TOKENIZERS_PARALLELISM, spelled as the library reads it, switches its batch threads off."""
  if value is None:
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
  else:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", value)
  assert tokenizer_lib.load_tokenizer(hf_dir).batch_threads is threads


def test_encode_documents_sentencepiece(sp_model):
  tok = tokenizer_lib.load_tokenizer(sp_model)
  assert not tok.batch_threads
  assert_batch_matches_documents(tok, BATCH_TEXTS)


# --- Errors -------------------------------------------------------------------------------------


def test_check_vocab():
  tok = tokenizer_lib.ByteTokenizer()
  tokenizer_lib.check_vocab(tok, 258)
  tokenizer_lib.check_vocab(tok, 384)  # larger (padded) model vocab is fine
  with pytest.raises(ConfigError) as e:
    tokenizer_lib.check_vocab(tok, 257)
  assert str(e.value) == ("model.vocab_size=257: smaller than the tokenizer's vocabulary (byte has "
                          "258 ids); set model.vocab_size >= 258 or use the model's own tokenizer")


def test_check_vocab_names_the_hf_path(hf_dir):
  tok = tokenizer_lib.load_tokenizer(hf_dir)
  with pytest.raises(ConfigError) as e:
    tokenizer_lib.check_vocab(tok, 256)
  msg = str(e.value)
  assert msg.startswith("model.vocab_size=256: smaller than the tokenizer's vocabulary")
  assert os.path.join(hf_dir, "tokenizer.json") in msg and "has 300 ids" in msg
  assert "set model.vocab_size >= 300" in msg and "\n" not in msg


@pytest.mark.parametrize("spec", ["bytes", "gpt2", "", "llama:/x"])
def test_unknown_spec(spec):
  with pytest.raises(ConfigError, match='unknown tokenizer|expected "byte"'):
    tokenizer_lib.load_tokenizer(spec)


def test_missing_paths(tmp_path):
  cases = {
      "hf:" + str(tmp_path / "nope" / "tokenizer.json"): "does not exist; expected a Hugging Face",
      str(tmp_path / "nope" / "tokenizer.json"): "does not exist; expected a Hugging Face",
      "hf:" + str(tmp_path): "directory has no tokenizer.json",
      "sentencepiece:" + str(tmp_path / "x.model"): "does not exist; expected a SentencePiece",
      str(tmp_path / "x.model"): "does not exist; expected a SentencePiece",
      str(tmp_path): "holds neither tokenizer.json nor tokenizer.model",
      str(tmp_path / "missing_dir"): "missing_dir does not exist; expected \"byte\"",
  }
  (tmp_path / "notes.txt").write_text("x")
  cases[str(tmp_path / "notes.txt")] = "is neither a tokenizer.json, a .model file nor a directory"
  for spec, fragment in cases.items():
    with pytest.raises(ConfigError) as e:
      tokenizer_lib.load_tokenizer(spec)
    msg = str(e.value)
    assert fragment in msg, (spec, msg)
    assert str(tmp_path) in msg, (spec, msg)


def test_corrupt_files(tmp_path):
  bad_json = tmp_path / "tokenizer.json"
  bad_json.write_text("{not json")
  with pytest.raises(ConfigError, match=f"cannot read {bad_json} as a Hugging Face tokenizer"):
    tokenizer_lib.load_tokenizer(str(bad_json))
  bad_model = tmp_path / "bad.model"
  bad_model.write_bytes(b"\x00\x01garbage")
  with pytest.raises(ConfigError, match=f"cannot read {bad_model} as a SentencePiece model"):
    tokenizer_lib.load_tokenizer(str(bad_model))


def test_corrupt_tokenizer_config(tmp_path):
  train_hf_tokenizer(str(tmp_path))
  (tmp_path / "tokenizer_config.json").write_text("[1, 2")
  with pytest.raises(ConfigError, match="tokenizer_config.json: cannot read it as JSON"):
    tokenizer_lib.load_tokenizer(str(tmp_path))


# --- Chat ---------------------------------------------------------------------------------------


def test_render_chat_with_template(hf_dir):
  tok = tokenizer_lib.load_tokenizer(hf_dir)
  assert tokenizer_lib.render_chat(tok, MESSAGES) == "<s>[user] hi</s>[assistant] hello</s>"
  text = tokenizer_lib.render_chat(tok, MESSAGES[:1], add_generation_prompt=True)
  assert text == "<s>[user] hi</s>[assistant] "
  # Special-token text from the template encodes to the special ids.
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id and tok.eos_id in ids


def test_render_chat_template_helpers_and_sandbox(tmp_path):
  template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
              "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
              "{{ m | tojson }}{% endfor %}")
  train_hf_tokenizer(str(tmp_path), {"chat_template": template})
  tok = tokenizer_lib.load_tokenizer(str(tmp_path))
  # tojson keeps "<" and non-ASCII as is, unlike jinja2's HTML-escaping builtin.
  assert tokenizer_lib.render_chat(tok, [{"role": "user", "content": "<b>é"}]) == (
      '{"role": "user", "content": "<b>é"}')
  with pytest.raises(ConfigError, match="bad role tool"):
    tokenizer_lib.render_chat(tok, [{"role": "tool", "content": "x"}])

  escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
  train_hf_tokenizer(str(tmp_path), {"chat_template": escape})
  tok = tokenizer_lib.load_tokenizer(str(tmp_path))
  with pytest.raises(ConfigError, match="chat template failed: SecurityError"):
    tokenizer_lib.render_chat(tok, MESSAGES)


def test_render_chat_default_format(hf_bare_dir):
  tok = tokenizer_lib.load_tokenizer(hf_bare_dir)
  assert tokenizer_lib.render_chat(tok, MESSAGES, add_generation_prompt=True) == (
      "<|user|>\nhi\n<|assistant|>\nhello\n</s><|assistant|>\n")
  # The byte tokenizer's EOS has no text form, so nothing follows assistant turns.
  assert tokenizer_lib.render_chat(tokenizer_lib.ByteTokenizer(), MESSAGES) == (
      "<|user|>\nhi\n<|assistant|>\nhello\n")
  with pytest.raises(ValueError, match="message 0 has keys"):
    tokenizer_lib.render_chat(tok, [{"content": "no role"}])


# --- Pickle -------------------------------------------------------------------------------------


def test_pickle_round_trip(tmp_path, hf_dir, sp_model):
  import shutil

  # Copies, deleted before unpickling: the pickled state must not depend on the files.
  hf_copy = str(tmp_path / "hf")
  shutil.copytree(hf_dir, hf_copy)
  sp_copy = str(tmp_path / "sp.model")
  shutil.copy(sp_model, sp_copy)
  toks = [tokenizer_lib.load_tokenizer(s) for s in ("byte", hf_copy, sp_copy)]
  blobs = [pickle.dumps(t) for t in toks]
  shutil.rmtree(hf_copy)
  os.remove(sp_copy)
  for tok, blob in zip(toks, blobs):
    back = pickle.loads(blob)
    assert type(back) is type(tok)
    for attr in ("name", "vocab_size", "bos_id", "eos_id", "pad_id", "bos_token", "eos_token",
                 "chat_template"):
      assert getattr(back, attr) == getattr(tok, attr), attr
    np.testing.assert_array_equal(back.encode(TEXT), tok.encode(TEXT))
    doc = back.encode_document(TEXT, add_bos=True, add_eos=True)
    np.testing.assert_array_equal(doc, tok.encode_document(TEXT, add_bos=True, add_eos=True))
    assert back.decode(doc) == TEXT
