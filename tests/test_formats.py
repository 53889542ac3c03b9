"""Tests for fine-tuning record formats: which target tokens carry weight, per record kind.

Tokenizers: the byte tokenizer, a tiny byte-level BPE trained here (with <|start|>/<|end|> added
special tokens and a Llama 3 style header template), and a tiny SentencePiece model; each trains
in well under a second.
"""

import copy
import json
import os

import numpy as np
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.data import formats
from jaxtrain.data import tokenizer as tokenizer_lib
from jaxtrain.data.sources.common import DataError

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "jovial packing boxes of liquor and zebras graze near the river bank").split()
SENTENCES = [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 8 + i % 5)) + "."
             for i in range(300)]

# Llama 3's header style: the role header and the end-of-turn token are special tokens.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")

CHAT = {"messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "the fox?"},
                     {"role": "assistant", "content": "jumps over the dog."},
                     {"role": "user", "content": "and the wizards?"},
                     {"role": "assistant", "content": "they hex boxes."}]}
PAIR = {"prompt": "the lazy dog ", "chosen": "jumps over the fox.", "rejected": "sleeps."}


def train_bpe(directory, tokenizer_config):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<s>", "</s>", "[UNK]", "<|start|>", "<|end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(SENTENCES, trainer=trainer)
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config, f)
  return tokenizer_lib.load_tokenizer("hf:" + directory)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """BPE with BOS/EOS and TEMPLATE."""
  return train_bpe(str(tmp_path_factory.mktemp("hf")),
                   {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})


@pytest.fixture(scope="module")
def hf_plain(tmp_path_factory):
  """The same BPE without a chat template: render_chat's default format."""
  return train_bpe(str(tmp_path_factory.mktemp("hf_plain")),
                   {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
  """SentencePiece, whose encode does not map "<s>"/"</s>" text to the BOS/EOS ids."""
  import sentencepiece as spm

  prefix = os.path.join(str(tmp_path_factory.mktemp("sp")), "sp")
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(SENTENCES), model_prefix=prefix, vocab_size=100, model_type="bpe",
      character_coverage=1.0, normalization_rule_name="identity", pad_id=0, unk_id=1,
      bos_id=2, eos_id=3, minloglevel=2)
  return tokenizer_lib.load_tokenizer(prefix + ".model")


@pytest.fixture
def byte():
  return tokenizer_lib.ByteTokenizer()


def with_template(tok, template):
  tok = copy.copy(tok)
  tok.chat_template = template
  return tok


def check_shapes(f):
  assert set(f) == {"inputs", "targets", "weights"}
  assert f["inputs"].dtype == f["targets"].dtype == np.int32
  assert f["weights"].dtype == np.float32
  assert len(f["inputs"]) == len(f["targets"]) == len(f["weights"])
  np.testing.assert_array_equal(f["inputs"][1:], f["targets"][:-1])  # one shifted sequence
  assert set(np.unique(f["weights"]).tolist()) <= {0.0, 1.0}


def ids_of(f):
  return np.concatenate([f["inputs"][:1], f["targets"]])


def trained(f):
  return f["targets"][f["weights"] > 0]


def trained_runs(f):
  """The trained targets as a list of contiguous runs of ids."""
  runs, run = [], []
  for t, w in zip(f["targets"].tolist(), f["weights"].tolist()):
    if w:
      run.append(t)
    elif run:
      runs, run = runs + [run], []
  return runs + [run] if run else runs


# --- Plain documents and truncation -------------------------------------------------------------


def test_lm_features_shift_and_weights():
  f = formats.lm_features([5, 6, 7, 8])
  check_shapes(f)
  np.testing.assert_array_equal(f["inputs"], [5, 6, 7])
  np.testing.assert_array_equal(f["targets"], [6, 7, 8])
  np.testing.assert_array_equal(f["weights"], [1, 1, 1])
  assert all(len(v) == 0 for v in formats.lm_features([5]).values())
  with pytest.raises(DataError, match="1-D array of integer"):
    formats.lm_features([[1, 2]])
  with pytest.raises(DataError, match="1-D array of integer"):
    formats.lm_features([0.5, 1.5])


def test_text_records(byte):
  f = formats.record_features(byte, "hi", "text")
  np.testing.assert_array_equal(ids_of(f), [257, ord("h"), ord("i"), 256])
  np.testing.assert_array_equal(f["weights"], [1, 1, 1])
  g = formats.record_features(byte, {"text": "hi"}, "text", add_bos=False, add_eos=False)
  np.testing.assert_array_equal(ids_of(g), [ord("h"), ord("i")])
  with pytest.raises(DataError, match=r"^record 4: text record: missing key 'text' \(keys: "
                     r"'body'\); expected a string or \{\"text\": str\}$"):
    formats.record_features(byte, {"body": "hi"}, "text", where=4)
  with pytest.raises(DataError, match="text record: the record is a number"):
    formats.record_features(byte, 3, "text")


def test_truncate():
  f = formats.lm_features(np.arange(10))
  same, cut = formats.truncate(f, 9)
  assert not cut and all(len(v) == 9 for v in same.values())
  short, cut = formats.truncate(f, 4)
  assert cut
  np.testing.assert_array_equal(short["inputs"], [0, 1, 2, 3])
  np.testing.assert_array_equal(short["targets"], [1, 2, 3, 4])
  assert len(short["weights"]) == 4
  pair = {"chosen": formats.lm_features(np.arange(10)), "rejected": formats.lm_features([1, 2])}
  out, cut = formats.truncate(pair, 5)
  assert cut and len(out["chosen"]["targets"]) == 5 and len(out["rejected"]["targets"]) == 1
  assert formats.truncate(pair, 9)[1] is False
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="max_len"):
      formats.truncate(f, bad)


# --- Prompt / completion ------------------------------------------------------------------------


@pytest.mark.parametrize("tok_name", ["byte", "hf"])
def test_prompt_completion_weights_exactly_completion_and_eos(tok_name, byte, hf):
  tok = {"byte": byte, "hf": hf}[tok_name]
  record = {"prompt": "the quick fox ", "completion": "jumps over the dog."}
  f = formats.prompt_completion_features(tok, record)
  check_shapes(f)
  prompt, completion = tok.encode(record["prompt"]), tok.encode(record["completion"])
  np.testing.assert_array_equal(ids_of(f), [tok.bos_id, *prompt, *completion, tok.eos_id])
  np.testing.assert_array_equal(trained(f), [*completion, tok.eos_id])
  assert trained(f)[-1] == tok.eos_id
  assert tok.decode(trained(f)) == record["completion"]  # decode drops the EOS
  # Weight starts at the first completion token: the target after the last prompt token.
  assert f["weights"].tolist() == [0.0] * len(prompt) + [1.0] * (len(completion) + 1)

  g = formats.prompt_completion_features(tok, record, add_bos=False, add_eos=False)
  np.testing.assert_array_equal(ids_of(g), [*prompt, *completion])
  np.testing.assert_array_equal(trained(g), completion)


def test_prompt_completion_empty_prompt(byte):
  f = formats.prompt_completion_features(byte, {"prompt": "", "completion": "ab"})
  np.testing.assert_array_equal(ids_of(f), [257, 97, 98, 256])
  np.testing.assert_array_equal(f["weights"], [1, 1, 1])


def test_prompt_completion_tokenizes_the_parts_separately(hf):
  # "the" + " fox" may not split where "the fox" would; the boundary must be exact anyway.
  f = formats.prompt_completion_features(hf, {"prompt": "the", "completion": " fox"})
  np.testing.assert_array_equal(trained(f), [*hf.encode(" fox"), hf.eos_id])


PC_SHAPE = r'; expected \{"prompt": str, "completion": str\} with a non-empty completion$'


@pytest.mark.parametrize("record,where,message", [
    ({"completion": "x"}, 7, r"^record 7: prompt_completion record: missing key 'prompt' "
     r"\(keys: 'completion'\)"),
    ({"prompt": "x"}, "a.jsonl:3", r"^a\.jsonl:3: prompt_completion record: missing key "
     r"'completion'"),
    ({"prompt": 1, "completion": "x"}, None, r"^record: prompt_completion record: 'prompt' is a "
     r"number, not a string"),
    ({"prompt": "x", "completion": None}, 0, r"^record 0: prompt_completion record: "
     r"'completion' is null, not a string"),
    ({"prompt": "x", "completion": ""}, 2, r"^record 2: prompt_completion record: 'completion' "
     r"is empty, so there is nothing to train on"),
    (["x", "y"], 1, r"^record 1: prompt_completion record: the record is an array, not an "
     r"object"),
])
def test_prompt_completion_errors(byte, record, where, message):
  with pytest.raises(DataError, match=message + ".*" + PC_SHAPE):
    formats.record_features(byte, record, "prompt_completion", where=where)


def test_missing_specials_are_config_errors(byte):
  no_specials = copy.copy(byte)
  no_specials.bos_id = no_specials.eos_id = None
  with pytest.raises(ConfigError, match="add_bos=True: tokenizer byte has no BOS"):
    formats.prompt_completion_features(no_specials, {"prompt": "a", "completion": "b"})
  with pytest.raises(ConfigError, match="add_eos=True: tokenizer byte has no EOS"):
    formats.prompt_completion_features(no_specials, {"prompt": "a", "completion": "b"},
                                       add_bos=False)


# --- Chat ---------------------------------------------------------------------------------------


def test_chat_single_turn_with_template(hf):
  record = {"messages": [{"role": "user", "content": "the fox?"},
                         {"role": "assistant", "content": "jumps over the dog."}]}
  f = formats.chat_features(hf, record)
  check_shapes(f)
  start, end = hf._tok.token_to_id("<|start|>"), hf._tok.token_to_id("<|end|>")
  ids = ids_of(f)
  # The template writes "<s>": exactly one BOS, as the id, and never a second one.
  assert ids[0] == hf.bos_id and (ids == hf.bos_id).sum() == 1
  # The whole conversation is the template's rendering, BOS text as the BOS id.
  text = tokenizer_lib.render_chat(hf, record["messages"])
  np.testing.assert_array_equal(ids, hf.encode(text))
  # Loss only on the assistant's content and its end-of-turn token, not on its header.
  np.testing.assert_array_equal(trained(f), [*hf.encode("jumps over the dog."), end])
  assert hf.decode(trained(f)) == "jumps over the dog."
  header = hf.encode("<|start|>assistant\n")
  assert header[0] == start
  n_header = len(header)
  first = int(np.argmax(f["weights"]))
  np.testing.assert_array_equal(f["targets"][first - n_header:first], header)


def test_chat_multi_turn(hf):
  f = formats.chat_features(hf, CHAT, where=0)
  check_shapes(f)
  end = hf._tok.token_to_id("<|end|>")
  runs = trained_runs(f)
  assert runs == [[*hf.encode("jumps over the dog."), end], [*hf.encode("they hex boxes."), end]]
  # System and user turns (their content and end tokens) carry no weight.
  untrained = f["targets"][f["weights"] == 0]
  assert hf.decode(untrained) == "system\nbe brief" + "user\nthe fox?" + "assistant\n" + \
      "user\nand the wizards?" + "assistant\n"

  last = formats.chat_features(hf, CHAT, train_on="last_assistant")
  assert trained_runs(last) == runs[1:]
  np.testing.assert_array_equal(ids_of(last), ids_of(f))

  every = formats.chat_features(hf, CHAT, train_on="all")
  np.testing.assert_array_equal(ids_of(every), ids_of(f))
  assert every["weights"].all()
  with pytest.raises(ConfigError, match="train_on='user'"):
    formats.chat_features(hf, CHAT, train_on="user")


def test_chat_bos_flags(hf):
  ids = ids_of(formats.chat_features(hf, CHAT))
  on = ids_of(formats.chat_features(hf, CHAT, add_bos=True))
  off = ids_of(formats.chat_features(hf, CHAT, add_bos=False))
  np.testing.assert_array_equal(on, ids)
  np.testing.assert_array_equal(off, ids[1:])
  # A template without BOS: none by default, one when asked.
  no_bos = with_template(hf, TEMPLATE.replace("{{ bos_token }}", ""))
  np.testing.assert_array_equal(ids_of(formats.chat_features(no_bos, CHAT)), ids[1:])
  np.testing.assert_array_equal(ids_of(formats.chat_features(no_bos, CHAT, add_bos=True)), ids)
  # add_eos=True appends the EOS id, trained.
  f = formats.chat_features(hf, CHAT, add_eos=True)
  assert ids_of(f)[-1] == hf.eos_id and f["weights"][-1] == 1
  np.testing.assert_array_equal(ids_of(f)[:-1], ids)


def test_chat_default_format_hf(hf_plain):
  """No template: render_chat's default format, whose EOS text after assistant turns is the id."""
  assert hf_plain.chat_template is None
  f = formats.chat_features(hf_plain, CHAT)
  check_shapes(f)
  ids = ids_of(f)
  assert ids[0] == hf_plain.bos_id and (ids == hf_plain.bos_id).sum() == 1
  runs = trained_runs(f)
  assert len(runs) == 2 and all(r[-1] == hf_plain.eos_id for r in runs)
  assert [hf_plain.decode(r) for r in runs] == ["jumps over the dog.\n", "they hex boxes.\n"]
  assert ids[-1] == hf_plain.eos_id  # no second EOS appended


def test_chat_default_format_byte(byte):
  """The byte tokenizer has no EOS text: the default add_eos appends the EOS id so it can stop."""
  record = {"messages": CHAT["messages"][1:3]}
  f = formats.chat_features(byte, record)
  check_shapes(f)
  text = "<|user|>\nthe fox?\n<|assistant|>\njumps over the dog.\n"
  assert text == tokenizer_lib.render_chat(byte, record["messages"])
  np.testing.assert_array_equal(ids_of(f), [257, *byte.encode(text), 256])
  np.testing.assert_array_equal(trained(f), [*byte.encode("jumps over the dog.\n"), 256])
  g = formats.chat_features(byte, record, add_bos=False, add_eos=False)
  np.testing.assert_array_equal(ids_of(g), byte.encode(text))


def test_chat_sentencepiece_bos_and_eos_text_become_ids(sp):
  """SentencePiece encodes "<s>" and "</s>" text as ordinary pieces; the template's become ids."""
  tok = with_template(sp, "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                      "{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
                      "{% endif %}\n{% endfor %}")
  assert len(sp.encode("<s>")) > 1 and len(sp.encode("</s>")) > 1
  f = formats.chat_features(tok, {"messages": CHAT["messages"][1:3]})
  ids = ids_of(f)
  assert ids[0] == sp.bos_id and (ids == sp.bos_id).sum() == 1
  runs = trained_runs(f)
  # The template's EOS text is the last token of the trained turn (trim_blocks eats the "\n").
  assert len(runs) == 1 and runs[0][-1] == sp.eos_id and runs[0].count(sp.eos_id) == 1
  assert sp.decode(runs[0]).strip() == "jumps over the dog."


def test_chat_header_found_by_content_without_generation_prompt(byte):
  """A template that ignores add_generation_prompt: the header is the text before the content."""
  tok = with_template(byte, "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n"
                      "{% endfor %}")
  f = formats.chat_features(tok, {"messages": CHAT["messages"][1:3]})
  assert byte.decode(trained(f)) == "jumps over the dog.\n"  # add_eos off: a template is set
  assert ids_of(f)[0] == ord("#")  # the byte tokenizer's default add_bos with a template: none


def test_chat_template_not_prefix_stable(byte):
  # Earlier assistant turns are hidden once a later turn follows (like dropping old reasoning).
  # trim_blocks (as in transformers) eats the "\n" after {% endif %}.
  tok = with_template(byte, "{% for m in messages %}{% if m['role'] == 'assistant' and not "
                      "loop.last %}[hidden]{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")
  with pytest.raises(DataError, match=r"^train\.jsonl:9: chat record: the chat template of byte "
                     r"is not prefix-stable: the rendering of messages\[:3\] is not a prefix of "
                     r"that of messages\[:4\] \(they differ at character 16: 'jumps over the "
                     r"dog\.' vs '\[hidden\]and"):
    formats.chat_features(tok, CHAT, where="train.jsonl:9")


def test_chat_template_errors(byte):
  tok = with_template(byte, "{% for m in messages %}{% if m['role'] == 'system' %}"
                      "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}"
                      "{% endfor %}")
  with pytest.raises(DataError, match=r"^record 5: chat record: rendering messages\[:1\] failed: "
                     r".*no system role"):
    formats.chat_features(tok, CHAT, where=5)
  broken = with_template(byte, "{% for m in messages %}")
  with pytest.raises(ConfigError, match="chat template failed: TemplateSyntaxError") as e:
    formats.chat_features(broken, CHAT)
  assert not isinstance(e.value, DataError)


CHAT_SHAPE = (r'; expected \{"messages": \[\{"role": "system"\|"user"\|"assistant", '
              r'"content": str\}, \.\.\.\]\} ending with a non-empty assistant message$')
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("record,message", [
    ("hi", "the record is a string, not an object"),
    ({"conversation": []}, r"missing key 'messages' \(keys: 'conversation'\)"),
    ({"messages": "hi"}, "'messages' is a string, not a list of messages"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": [USER, "hello"]}, r"messages\[1\] is a string, not an object"),
    ({"messages": [{"content": "hi"}]}, r"messages\[0\] has no 'role' \(keys: 'content'\)"),
    ({"messages": [{"role": "user", "text": "hi"}]}, r"messages\[0\] has no 'content' "
     r"\(keys: 'role', 'text'\)"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, r"messages\[0\] has role 'bot'; roles "
     r"are 'system', 'user', 'assistant'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, r"messages\[0\] content is an array, "
     r"not a string"),
    ({"messages": [USER]}, r"the last message \(messages\[0\]\) is from 'user'; training "
     r"conversations must end with the assistant's reply"),
    ({"messages": [USER, {"role": "assistant", "content": ""}]}, r"the last message "
     r"\(messages\[1\]\) is an empty assistant reply, so there is nothing to train on"),
])
def test_chat_record_errors(byte, record, message):
  with pytest.raises(DataError, match=r"^record 3: chat record: " + message + ".*" + CHAT_SHAPE):
    formats.record_features(byte, record, "chat", where=3)


# --- Preference ---------------------------------------------------------------------------------


def check_pair(out, prompt_len):
  assert set(out) == {"chosen", "rejected"}
  for f in out.values():
    check_shapes(f)
    # Weight exactly on the targets after the prompt.
    assert f["weights"].tolist() == [0.0] * (prompt_len - 1) + \
        [1.0] * (len(f["weights"]) - prompt_len + 1)
  np.testing.assert_array_equal(ids_of(out["chosen"])[:prompt_len],
                                ids_of(out["rejected"])[:prompt_len])


@pytest.mark.parametrize("tok_name", ["byte", "hf"])
def test_preference_text_prompt(tok_name, byte, hf):
  tok = {"byte": byte, "hf": hf}[tok_name]
  out = formats.preference_features(tok, PAIR)
  prompt = [tok.bos_id, *tok.encode(PAIR["prompt"])]
  check_pair(out, len(prompt))
  for side in ("chosen", "rejected"):
    np.testing.assert_array_equal(ids_of(out[side]),
                                  [*prompt, *tok.encode(PAIR[side]), tok.eos_id])
    assert tok.decode(trained(out[side])) == PAIR[side]
  dispatched = formats.record_features(tok, PAIR, "preference")
  np.testing.assert_array_equal(dispatched["chosen"]["targets"], out["chosen"]["targets"])


def test_preference_chat_prompt(hf):
  record = {"prompt": CHAT["messages"][:4], "chosen": "they hex boxes.", "rejected": "no."}
  out = formats.preference_features(hf, record, where=1)
  end = hf._tok.token_to_id("<|end|>")
  prompt_text = tokenizer_lib.render_chat(hf, record["prompt"], add_generation_prompt=True)
  prompt = hf.encode(prompt_text)
  assert prompt[0] == hf.bos_id and (prompt == hf.bos_id).sum() == 1
  check_pair(out, len(prompt))
  for side in ("chosen", "rejected"):
    np.testing.assert_array_equal(trained(out[side]), [*hf.encode(record[side]), end])
  # The earlier assistant turn in the prompt carries no weight: only the response does.
  assert len(trained_runs(out["chosen"])) == 1


def test_preference_chat_prompt_without_generation_prompt(byte):
  tok = with_template(byte, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}>>>{% endif %}")
  record = {"prompt": [USER], "chosen": "a", "rejected": "b"}
  with pytest.raises(DataError, match=r"^record 2: preference record: the chat template of byte "
                     r"renders the prompt with the generation prompt as text that is not a prefix"):
    formats.preference_features(tok, record, where=2)


PREF_SHAPE = (r'; expected \{"prompt": str or \[\{"role": \.\.\., "content": str\}, \.\.\.\], '
              r'"chosen": str, "rejected": str\} with non-empty chosen and rejected$')


@pytest.mark.parametrize("record,message", [
    ({"chosen": "a", "rejected": "b"}, "missing key 'prompt'"),
    ({"prompt": "p", "rejected": "b"}, "missing key 'chosen'"),
    ({"prompt": "p", "chosen": "a"}, "missing key 'rejected'"),
    ({"prompt": "p", "chosen": "a", "rejected": 2}, "'rejected' is a number, not a string"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "'chosen' is empty"),
    ({"prompt": 5, "chosen": "a", "rejected": "b"}, "'prompt' is a number; expected a string "
     "or a list of messages"),
    ({"prompt": [], "chosen": "a", "rejected": "b"}, "'prompt' is empty"),
    ({"prompt": [{"role": "x", "content": "hi"}], "chosen": "a", "rejected": "b"},
     r"prompt\[0\] has role 'x'"),
])
def test_preference_record_errors(byte, record, message):
  with pytest.raises(DataError, match=r"^record 8: preference record: " + message + ".*" +
                     PREF_SHAPE):
    formats.record_features(byte, record, "preference", where=8)


def test_unknown_kind(byte):
  with pytest.raises(ConfigError, match="record kind 'sft': unknown; choose one of text, "
                     "prompt_completion, chat, preference"):
    formats.record_features(byte, {}, "sft")
