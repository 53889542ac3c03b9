"""One tokenizer interface over byte, Hugging Face `tokenizers` and SentencePiece tokenizers.

`load_tokenizer(spec)` picks the kind from a spec string:
  "byte"                        `ByteTokenizer`: UTF-8 bytes 0..255, EOS 256, BOS 257.
  "hf:PATH"                     `HFTokenizer`: PATH is a `tokenizer.json` or a directory with one.
                                PATH may be an s3:// or gs:// URL (jaxtrain/storage.py): the file
                                and its tokenizer_config.json / chat_template.jinja are downloaded
                                into the URL's staging directory and read from there.
  "sentencepiece:PATH"          `SentencePieceTokenizer`: PATH is a SentencePiece `.model` file
                                (or its URL).
  a bare path                   `tokenizer.json` (or any `.json`) -> HF, `.model` -> SentencePiece,
                                a directory -> its `tokenizer.json`, else its `tokenizer.model`.

Every tokenizer has the same members: `name`, `vocab_size` (max id + 1), `bos_id`/`eos_id`/
`pad_id` (None when absent), `bos_token`/`eos_token` (their text, None when absent or when the
kind has no text form for them), `chat_template`, and the methods `encode` (never adds special
tokens), `decode`, `encode_document` (adds BOS/EOS per flags) and `encode_documents` (the same
for a batch of texts, which the HF kind encodes on several threads at once; `batch_threads` says
whether a kind does).

Tokenizers pickle (grain pickles the map functions that hold one into its worker processes). The
library objects are pickled as their serialized content rather than as a path to reload, so a
worker gets exactly the tokenizer the parent loaded even if the file changed or is not visible
from where the worker runs.
"""

from __future__ import annotations

import abc
import datetime
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data import tokenizer_files

# Fallbacks when no tokenizer_config.json names the specials, tried in order; the first token in
# the vocab wins. Llama 3 names first, then Llama 2 / SentencePiece-style names, then GPT-2 style.
# For EOS, "<|end_of_text|>" (document end, what pretraining separates documents with) comes
# before "<|eot_id|>" (end of a chat turn), which is only used when nothing else exists.
HF_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>")
HF_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<|eot_id|>")
HF_PAD_CANDIDATES = ("<pad>", "[PAD]")

SPEC_HELP = ('expected "byte", "hf:PATH" (a tokenizer.json or a directory holding one), '
             '"sentencepiece:PATH" (a .model file), or a path to a tokenizer.json, a .model file '
             'or a directory holding one of them')


class Tokenizer(abc.ABC):
  """What the data pipeline needs from a tokenizer; see the module docstring for the members."""

  name: str
  vocab_size: int
  bos_id: int | None = None
  eos_id: int | None = None
  pad_id: int | None = None
  bos_token: str | None = None
  eos_token: str | None = None
  chat_template: str | None = None
  # True when `encode_documents` runs on threads of the tokenizer library (Rust's rayon pool for
  # HF): prepare then sizes worker processes x threads to the CPUs instead of stacking them.
  batch_threads: bool = False

  @abc.abstractmethod
  def encode(self, text: str) -> np.ndarray:
    """int32 ids of `text`, with no special tokens added."""

  @abc.abstractmethod
  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`. Special tokens (BOS, EOS, pad) and ids outside [0, vocab_size) are dropped:
    a model's vocab may be padded past the tokenizer's, and sampling can emit those ids."""

  def encode_document(self, text: str, *, add_bos: bool, add_eos: bool) -> np.ndarray:
    """int32 ids of `text` with BOS in front and EOS behind, each when its flag is set."""
    bos, eos = self._specials(add_bos, add_eos)
    # int32 parts: an empty list would join as float64 and send every id through float and back.
    parts = [np.array(bos, np.int32), self.encode(text), np.array(eos, np.int32)]
    return np.concatenate(parts).astype(np.int32, copy=False)

  def encode_documents(self, texts: Sequence[str], *, add_bos: bool,
                       add_eos: bool) -> list[np.ndarray]:
    """`encode_document` of each text, in order; kinds that can encode a batch faster override
    this with identical results."""
    return [self.encode_document(t, add_bos=add_bos, add_eos=add_eos) for t in texts]

  def _specials(self, add_bos: bool, add_eos: bool) -> tuple[list[int], list[int]]:
    """([BOS] or [], [EOS] or []) as the flags ask; ConfigError when a flagged one is absent."""
    bos = [self._special_id("BOS", self.bos_id, "add_bos")] if add_bos else []
    eos = [self._special_id("EOS", self.eos_id, "add_eos")] if add_eos else []
    return bos, eos

  def _special_id(self, what: str, token_id: int | None, flag: str) -> int:
    if token_id is None:
      raise ConfigError(f"{flag}=True: tokenizer {self.name} has no {what} token; set "
                        f"{flag}=False or use a tokenizer that has one")
    return token_id

  def _in_vocab(self, ids: Iterable[int]) -> list[int]:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    return ids[(ids >= 0) & (ids < self.vocab_size)].tolist()

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})")


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as ids 0..255, EOS 256 (the stdlib corpus's EOS_ID), BOS 257; no pad.

  Specials have no text form: `bos_token`/`eos_token` are None, so `render_chat` writes no EOS
  text after assistant turns.
  """

  def __init__(self):
    self.name = "byte"
    self.eos_id = 256
    self.bos_id = 257
    self.vocab_size = 258

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_documents(self, texts: Sequence[str], *, add_bos: bool,
                       add_eos: bool) -> list[np.ndarray]:
    """`encode_document` of each text, as views into one int32 array filled from the batch's
    joined bytes: numpy's per-call overhead is paid per batch rather than per text, which
    tokenizes short texts ~3x faster."""
    bos, eos = self._specials(add_bos, add_eos)
    data = [t.encode("utf-8") for t in texts]
    if not data:
      return []
    sizes = np.fromiter(map(len, data), np.int64, len(data)) + len(bos) + len(eos)
    ends = np.cumsum(sizes)
    out = np.empty(int(ends[-1]), np.int32)
    flat = np.frombuffer(b"".join(data), dtype=np.uint8)
    if bos or eos:
      is_text = np.ones(len(out), bool)
      if bos:
        is_text[ends - sizes] = False
        out[ends - sizes] = bos[0]
      if eos:
        is_text[ends - 1] = False
        out[ends - 1] = eos[0]
      out[is_text] = flat
    else:
      out[:] = flat
    return np.split(out, ends[:-1])

  def decode(self, ids: Iterable[int]) -> str:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    # Model output may cut a multi-byte character; "replace" keeps decoding usable for samples.
    return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes().decode("utf-8", "replace")


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizers` tokenizer from a `tokenizer.json` (or a directory holding one).

  Specials and the chat template come from a `tokenizer_config.json` beside it when present
  (`bos_token`/`eos_token`/`pad_token` as strings or {"content": ...} dicts, `chat_template`; a
  `chat_template.jinja` file beside it takes precedence, as in `transformers`). A special the
  config does not name is looked up in the vocab: BOS in `HF_BOS_CANDIDATES`, EOS in
  `HF_EOS_CANDIDATES`, pad in `HF_PAD_CANDIDATES`, first match wins.

  Added special tokens written in the text (e.g. "<|eot_id|>" from a chat template) encode to
  their ids, as in `transformers`; `encode` only never *adds* specials.
  """

  @property
  def batch_threads(self) -> bool:
    # TOKENIZERS_PARALLELISM set to a false value (the library's own spelling of it) makes the
    # library encode batches on the calling thread alone.
    value = os.environ.get("TOKENIZERS_PARALLELISM")
    return value is None or value.lower() not in ("", "off", "false", "f", "no", "n", "0")

  def __init__(self, path: str):
    import tokenizers  # pylint: disable=import-outside-toplevel

    if "://" in path:  # the name keeps the URL; the libraries read the staged copy
      url = tokenizer_files.hf_url(path)
      self.name = "hf:" + url
      path = tokenizer_files.staged(url, self.name, siblings=("tokenizer_config.json", "chat_template.jinja"))
    else:
      path = _resolve_hf_path(path)
      self.name = "hf:" + path
    self.path = path
    try:
      tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust library raises a bare Exception
      raise ConfigError(f"tokenizer {self.name}: cannot read {path} as a Hugging Face "
                        f"tokenizer.json ({type(e).__name__}: {e})") from e
    self._set_tokenizer(tok)

    config = _read_tokenizer_config(os.path.dirname(path))
    self.bos_id, self.bos_token = self._special(config, "bos_token", HF_BOS_CANDIDATES)
    self.eos_id, self.eos_token = self._special(config, "eos_token", HF_EOS_CANDIDATES)
    self.pad_id, _ = self._special(config, "pad_token", HF_PAD_CANDIDATES)
    self.chat_template = _read_chat_template(os.path.dirname(path), config)

  def _set_tokenizer(self, tok) -> None:
    self._tok = tok
    # get_vocab_size can undercount when ids have holes (added tokens placed past the model
    # vocab); the max id is what an embedding table must cover.
    vocab = tok.get_vocab(with_added_tokens=True)
    max_id = max(vocab.values()) if vocab else -1
    self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max_id + 1)

  def _special(self, config: Mapping[str, Any], key: str,
               candidates: Sequence[str]) -> tuple[int | None, str | None]:
    """(id, text) of a special token: named by tokenizer_config.json, else the first candidate
    in the vocab, else (None, None)."""
    if key in config:
      value = config[key]
      text = value.get("content") if isinstance(value, Mapping) else value
      if text is None:  # explicitly null: the tokenizer has none
        return None, None
      if not isinstance(text, str):
        raise ConfigError(f"tokenizer {self.name}: {key} in tokenizer_config.json is {value!r}; "
                          f"expected a string or a dict with \"content\"")
      token_id = self._tok.token_to_id(text)
      if token_id is None:
        raise ConfigError(f"tokenizer {self.name}: {key}={text!r} from tokenizer_config.json is "
                          f"not in the vocabulary of {self.path}; fix or remove {key}")
      return token_id, text
    for text in candidates:
      token_id = self._tok.token_to_id(text)
      if token_id is not None:
        return token_id, text
    return None, None

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_documents(self, texts: Sequence[str], *, add_bos: bool,
                       add_eos: bool) -> list[np.ndarray]:
    """`encode_document` of each text, encoded by the library as one batch: in parallel on its
    rayon thread pool (RAYON_NUM_THREADS threads, default one per CPU; none when
    TOKENIZERS_PARALLELISM is false), with the GIL released while it runs."""
    bos, eos = self._specials(add_bos, add_eos)
    if self._tok.padding is not None:
      # The library pads a batch to its longest text, a text alone only to a fixed length:
      # encoding text by text keeps `encode_document`'s ids, whatever the padding settings.
      return super().encode_documents(texts, add_bos=add_bos, add_eos=add_eos)
    # The fast variant skips only the character offsets, which are not needed here; ids are the
    # same. add_special_tokens=False, as in `encode`: no post-processor template.
    encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
    return [np.array(bos + e.ids + eos, dtype=np.int32) for e in encodings]

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode(self._in_vocab(ids), skip_special_tokens=True)

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_tok"] = self._tok.to_str()
    return state

  def __setstate__(self, state):
    import tokenizers  # pylint: disable=import-outside-toplevel

    state = dict(state)
    tok = tokenizers.Tokenizer.from_str(state.pop("_tok"))
    self.__dict__.update(state)
    self._tok = tok


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece `.model` file; BOS/EOS/pad ids come from the model (-1 there: None).

  SentencePiece does not parse control tokens out of text: "<s>" written in text (e.g. by a chat
  template) encodes as ordinary pieces, not as the BOS id. Use `encode_document` flags for BOS/EOS.
  """

  def __init__(self, path: str):
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    if "://" in path:
      self.name = "sentencepiece:" + path
      path = tokenizer_files.staged(path, self.name)
    else:
      path = os.path.abspath(os.path.expanduser(path))
      self.name = "sentencepiece:" + path
    self.path = path
    if not os.path.isfile(path):
      problem = "is a directory" if os.path.isdir(path) else "does not exist"
      raise ConfigError(f"tokenizer {self.name}: {path} {problem}; expected a SentencePiece "
                        f".model file")
    try:
      sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # RuntimeError or OSError, depending on the failure
      raise ConfigError(f"tokenizer {self.name}: cannot read {path} as a SentencePiece model "
                        f"({type(e).__name__}: {e})") from e
    self._set_processor(sp)

  def _set_processor(self, sp) -> None:
    self._sp = sp
    self.vocab_size = sp.get_piece_size()
    ids = {}
    for attr in ("bos", "eos", "pad"):
      i = getattr(sp, attr + "_id")()
      ids[attr] = None if i < 0 else int(i)
    self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
    self.bos_token = None if self.bos_id is None else sp.id_to_piece(self.bos_id)
    self.eos_token = None if self.eos_id is None else sp.id_to_piece(self.eos_id)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text, out_type=int, add_bos=False, add_eos=False),
                      dtype=np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    specials = {self.bos_id, self.eos_id, self.pad_id} - {None}
    return self._sp.decode([i for i in self._in_vocab(ids) if i not in specials])

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_sp"] = self._sp.serialized_model_proto()
    return state

  def __setstate__(self, state):
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    state = dict(state)
    sp = spm.SentencePieceProcessor(model_proto=state.pop("_sp"))
    self.__dict__.update(state)
    self._sp = sp


def _resolve_hf_path(path: str) -> str:
  """Absolute path of the tokenizer.json that `path` (a file or a directory) names."""
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(path):
    candidate = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(candidate):
      raise ConfigError(f"tokenizer hf:{path}: directory has no tokenizer.json; expected a "
                        f"Hugging Face tokenizer.json file or a directory holding one")
    return candidate
  if not os.path.exists(path):
    raise ConfigError(f"tokenizer hf:{path}: {path} does not exist; expected a Hugging Face "
                      f"tokenizer.json file or a directory holding one")
  return path


def _read_tokenizer_config(directory: str) -> dict[str, Any]:
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"tokenizer config {path}: cannot read it as JSON "
                      f"({type(e).__name__}: {e})") from e
  if not isinstance(config, dict):
    raise ConfigError(f"tokenizer config {path}: expected a JSON object, got "
                      f"{type(config).__name__}")
  return config


def _read_chat_template(directory: str, config: Mapping[str, Any]) -> str | None:
  """The chat template: chat_template.jinja beside the tokenizer, else tokenizer_config.json's.

  The config's value may be a list of named templates ({"name", "template"}); "default" wins,
  else the first.
  """
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return f.read()
  template = config.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    template = named.get("default", next(iter(named.values()), None))
  return template if isinstance(template, str) else None


def load_tokenizer(spec: str) -> Tokenizer:
  """The tokenizer a spec names (see the module docstring); ConfigError when it cannot load."""
  if not isinstance(spec, str) or not spec.strip():
    raise ConfigError(f"tokenizer {spec!r}: {SPEC_HELP}")
  spec = spec.strip()
  if spec == "byte":
    return ByteTokenizer()
  if spec.startswith("hf:"):
    return HFTokenizer(spec[len("hf:"):])
  if spec.startswith("sentencepiece:"):
    return SentencePieceTokenizer(spec[len("sentencepiece:"):])

  path = os.path.expanduser(spec)
  if path.endswith(".json"):
    return HFTokenizer(path)
  if path.endswith(".model"):
    return SentencePieceTokenizer(path)
  if "://" in path:  # a directory on a bucket: Hugging Face's, the kind jaxtrain imports
    return HFTokenizer(path)
  if os.path.isdir(path):
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
      return HFTokenizer(path)
    if os.path.isfile(os.path.join(path, "tokenizer.model")):
      return SentencePieceTokenizer(os.path.join(path, "tokenizer.model"))
    raise ConfigError(f"tokenizer {spec!r}: directory {os.path.abspath(path)} holds neither "
                      f"tokenizer.json nor tokenizer.model")
  if os.path.exists(path):
    raise ConfigError(f"tokenizer {spec!r}: {os.path.abspath(path)} is neither a tokenizer.json, "
                      f"a .model file nor a directory; {SPEC_HELP}")
  if os.sep in path or (os.altsep and os.altsep in path):
    raise ConfigError(f"tokenizer {spec!r}: {os.path.abspath(path)} does not exist; {SPEC_HELP}")
  raise ConfigError(f"tokenizer {spec!r}: unknown tokenizer; {SPEC_HELP}")


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """ConfigError when the model cannot embed every id the tokenizer emits.

  A model vocab larger than the tokenizer's is fine (rows padded for sharding go unused).
  """
  if model_vocab_size < tokenizer.vocab_size:
    n = tokenizer.vocab_size
    raise ConfigError(f"model.vocab_size={model_vocab_size}: smaller than the tokenizer's "
                      f"vocabulary ({tokenizer.name} has {n} ids); set model.vocab_size >= {n} "
                      f"or use the model's own tokenizer")


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str):
  """A compiled template in the sandbox `transformers` uses, with the helpers its templates call.

  Cached by text: compiling on every conversation would dominate SFT preprocessing, and keeping
  the compiled template off the tokenizer keeps it picklable.
  """
  from jinja2 import ext  # pylint: disable=import-outside-toplevel
  from jinja2 import sandbox  # pylint: disable=import-outside-toplevel
  from jinja2.exceptions import TemplateError  # pylint: disable=import-outside-toplevel

  def raise_exception(message):
    raise TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson HTML-escapes <, >, & and ', which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(template)


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = False) -> str:
  """Text of a conversation, for SFT data and prompting.

  With a `chat_template` the tokenizer's jinja2 template renders it in a sandbox, given
  `messages`, `add_generation_prompt`, `bos_token` and `eos_token` (their text, "" when absent),
  as `transformers` does. Without one, the default format is, per message,

      <|{role}|>\\n{content}\\n

  followed by the tokenizer's EOS text after each assistant turn when it has one (so a model
  learns to stop), and `<|assistant|>\\n` at the end when `add_generation_prompt`. The default
  format's role markers are plain text, not special tokens.

  Raises:
    ConfigError: the template does not compile or raises (e.g. an unsupported role).
    ValueError: a message without "role" or "content" (default format only).
  """
  if tokenizer.chat_template is not None:
    from jinja2.exceptions import TemplateError  # pylint: disable=import-outside-toplevel

    try:
      return _compile_chat_template(tokenizer.chat_template).render(
          messages=list(messages), add_generation_prompt=add_generation_prompt,
          bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
    except TemplateError as e:
      raise ConfigError(f"tokenizer {tokenizer.name}: chat template failed: "
                        f"{type(e).__name__}: {e}") from e

  eos = tokenizer.eos_token or ""
  out = []
  for i, m in enumerate(messages):
    if "role" not in m or "content" not in m:
      raise ValueError(f"message {i} has keys {sorted(m)}; expected 'role' and 'content'")
    out.append(f"<|{m['role']}|>\n{m['content']}\n")
    if m["role"] == "assistant":
      out.append(eos)
  if add_generation_prompt:
    out.append("<|assistant|>\n")
  return "".join(out)
