"""Fine-tuning records -> per-document token features, the step before packing.

Every function here returns, for one document of token ids `ids` with per-token weights `w`, a
dict of equal-length 1-D arrays:

  inputs   int32    ids[:-1]
  targets  int32    ids[1:]
  weights  float32  w[1:]: 1.0 where the target token is trained on, 0.0 where it is not

(the packer later multiplies `weights` by its padding mask). What is trained on, per record kind:

  text               every token after the first (plain language modeling).
  prompt_completion  the completion's tokens and the EOS; never BOS or the prompt.
  chat               each assistant message's content and whatever the template writes after it
                     in the same turn (its end-of-turn token); never the assistant's role header,
                     nor system or user turns. `train_on` selects "last_assistant" or "all".
  preference         per side (chosen, rejected), the response's tokens and its end (EOS or end
                     of turn); both sides share exactly the same prompt ids.

Record shapes are in `RECORD_SHAPES`. `record_features` dispatches on the kind; malformed records
raise `DataError` naming the record (`where`), the problem and the expected shape.

Prompt and response are tokenized separately and concatenated, so the boundary between untrained
and trained tokens is exact. The ids can differ from tokenizing the concatenated text: a BPE merge
across the boundary (e.g. a prompt ending in a space and a completion starting with a word) is
not made, and SentencePiece adds its dummy-prefix space to each part. Models fine-tuned this way
see the same split at inference only if the prompt is tokenized on its own, which is what
generation does anyway.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.data.sources.common import DataError
from jaxtrain.data.record_checks import (RECORD_SHAPES, ROLES, check_last_assistant,
                                        check_mapping, check_messages, divergence, error, keys,
                                        string_field, type_name)
from jaxtrain.data.tokenizer import Tokenizer, render_chat

__all__ = [
    "KINDS", "RECORD_SHAPES", "ROLES", "TRAIN_ON", "chat_features", "lm_features",
    "preference_features", "prompt_completion_features", "prompt_ids", "record_features",
    "truncate",
]

# "prompt" records are GRPO's: a prompt to complete, no target text (see `prompt_ids`).
KINDS = ("text", "prompt_completion", "chat", "preference", "prompt")
TRAIN_ON = ("assistant", "last_assistant", "all")


# Features of one document: {"inputs", "targets", "weights"}.
Features = dict[str, np.ndarray]
# A stretch of token ids and whether its tokens are trained on (as targets).
_Piece = tuple[np.ndarray, bool]


def lm_features(ids) -> Features:
  """Features of a plain pre-training document: every target token is trained on.

  A document of fewer than 2 tokens gives empty arrays (no input/target pair).
  """
  ids = np.asarray(ids)
  if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
    raise DataError(f"lm_features: expected a 1-D array of integer token ids, got shape "
                    f"{ids.shape} and dtype {ids.dtype}")
  return _features([(ids.astype(np.int32), True)])


def prompt_completion_features(tokenizer: Tokenizer, record: Mapping[str, Any], *,
                               add_bos: bool = True, add_eos: bool = True,
                               where: str | int | None = None) -> Features:
  """Features of `{"prompt": str, "completion": str}`.

  ids = [BOS] + encode(prompt) + encode(completion) + [EOS], with weight on the completion's
  tokens and the EOS (the EOS teaches the model to stop). Prompt and completion are encoded
  separately, so the text is used verbatim: write any separator (space, newline) into one of them.
  An empty prompt is allowed; without BOS the first completion token is then only an input, never
  a target.

  Raises:
    DataError: the record is not of that shape, or its completion is empty.
    ConfigError: add_bos/add_eos with a tokenizer that has no BOS/EOS.
  """
  kind = "prompt_completion"
  check_mapping(record, kind, where)
  prompt = string_field(record, "prompt", kind, where)
  completion = string_field(record, "completion", kind, where)
  if not completion:
    raise error(where, kind, "'completion' is empty, so there is nothing to train on")
  return _features([
      (_bos_ids(tokenizer, add_bos), False),
      (tokenizer.encode(prompt), False),
      (tokenizer.encode(completion), True),
      (_eos_ids(tokenizer, add_eos), True),
  ])


def chat_features(tokenizer: Tokenizer, record: Mapping[str, Any], *,
                  add_bos: bool | None = None, add_eos: bool | None = None,
                  train_on: str = "assistant", where: str | int | None = None) -> Features:
  """Features of `{"messages": [{"role", "content"}, ...]}`, rendered by `render_chat`.

  The tokenizer's chat template renders the conversation when it has one, else `render_chat`'s
  default format. To place weights for any template, the conversation is rendered prefix by
  prefix (messages[:1], messages[:2], ...): each message's text is what its prefix adds to the
  previous one, and that text is tokenized on its own. For an assistant message the role header
  is split off as what `add_generation_prompt` renders (else as the text before the content
  first appears); the rest (content and end-of-turn) is trained on.

  Args:
    tokenizer: renders and encodes the conversation. The BOS/EOS token texts in the rendered
      text are mapped to their ids even where the tokenizer does not parse them (SentencePiece),
      so a template's end-of-turn "</s>" is one trainable token, not the pieces of "</s>".
    record: the conversation; it must end with a non-empty assistant message.
    add_bos: None (default): with a chat template, a BOS exactly when the template writes one
      (Llama 3's do); without one, a BOS when the tokenizer has one, as for pre-training
      documents. True/False: exactly one BOS / none. A BOS text the template writes at the start
      is stripped either way, so BOS never doubles and is always the id.
    add_eos: None (default): append the EOS id only with the default format when the tokenizer
      has an EOS id but no EOS text (the byte tokenizer), since `render_chat` then writes no end
      of turn and the model could not learn to stop. True: append the EOS id unless the ids end
      with it already. False: never. An appended EOS is trained on.
    train_on: "assistant" (every assistant turn), "last_assistant" (only the final message), or
      "all" (every token, like a pre-training document of the rendered text).
    where: names the record in error messages (an index or "file:line").

  Raises:
    DataError: a malformed record, a template that rejects it, or a template that is not
      prefix-stable (it renders earlier turns differently once later turns follow, e.g. one that
      drops earlier reasoning), for which per-turn weights cannot be placed.
    ConfigError: a template that does not compile; add_bos/add_eos=True with a tokenizer that
      has no BOS/EOS; an unknown train_on.
  """
  if train_on not in TRAIN_ON:
    raise ConfigError(f"train_on={train_on!r}: choose one of {', '.join(TRAIN_ON)}")
  messages = check_messages(record, "chat", where)
  check_last_assistant(messages, "chat", where)
  return _features(_chat_pieces(tokenizer, messages, add_bos=add_bos, add_eos=add_eos,
                                train_on=train_on, where=where))


def preference_features(tokenizer: Tokenizer, record: Mapping[str, Any], *,
                        add_bos: bool | None = None, add_eos: bool | None = None,
                        where: str | int | None = None) -> dict[str, Features]:
  """`{"chosen": features, "rejected": features}` of a preference pair, for DPO.

  Both sides start with exactly the same prompt ids (encoded once), and only the response tokens
  carry weight, so a DPO loss can compare the two responses' log-probabilities under one prompt.

  A string prompt is raw text, like `prompt_completion_features`: ids = [BOS] + encode(prompt) +
  encode(response) + [EOS]; add_bos and add_eos default to True. A messages-list prompt (ending
  with a user turn, typically) is rendered with the chat template and the generation prompt, and
  each response as the assistant turn that follows; the response text is what the full
  conversation adds to the prompt rendering (its content and end-of-turn). add_bos and add_eos
  then default as in `chat_features`.

  Raises:
    DataError: a malformed record, an empty response, or a chat template whose generation prompt
      is not a prefix of the conversation with the response.
    ConfigError: as for `chat_features`.
  """
  kind = "preference"
  check_mapping(record, kind, where)
  if "prompt" not in record:
    raise error(where, kind, f"missing key 'prompt' (keys: {keys(record)})")
  responses = {}
  for side in ("chosen", "rejected"):
    responses[side] = string_field(record, side, kind, where)
    if not responses[side]:
      raise error(where, kind, f"{side!r} is empty, so there is nothing to compare")
  prompt = record["prompt"]

  if isinstance(prompt, str):
    prompt_ids = np.concatenate([_bos_ids(tokenizer, True if add_bos is None else add_bos),
                                 tokenizer.encode(prompt)])
    eos = _eos_ids(tokenizer, True if add_eos is None else add_eos)
    return {side: _features([(prompt_ids, False), (tokenizer.encode(text), True), (eos, True)])
            for side, text in responses.items()}

  if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, Mapping)):
    raise error(where, kind, f"'prompt' is {type_name(prompt)}; expected a string or a list "
                 f"of messages")
  messages = check_messages({"messages": prompt}, kind, where, key="prompt")
  specials = _unparsed_specials(tokenizer)
  prompt_text = _render(tokenizer, messages, True, where, "the prompt with the generation prompt",
                        kind)
  texts = {}
  for side, text in responses.items():
    full = _render(tokenizer, [*messages, {"role": "assistant", "content": text}], False, where,
                   f"the prompt followed by the {side} response", kind)
    if not full.startswith(prompt_text):
      raise error(where, kind, f"the chat template of {tokenizer.name} renders the prompt with "
                   f"the generation prompt as text that is not a prefix of the prompt followed "
                   f"by the {side} response ({divergence(prompt_text, full)}), so the response "
                   f"tokens cannot be told apart; use a template whose add_generation_prompt "
                   f"renders the assistant header", shape=False)
    texts[side] = full[len(prompt_text):]
  prompt_text, template_bos = _strip_bos_text(tokenizer, prompt_text)
  prompt_ids = np.concatenate([_bos_ids(tokenizer, _want_bos(tokenizer, add_bos, template_bos)),
                               _encode(tokenizer, prompt_text, specials)])
  out = {}
  for side, text in texts.items():
    response_ids = _encode(tokenizer, text, specials)
    out[side] = _features([(prompt_ids, False), (response_ids, True),
                           (_chat_eos_ids(tokenizer, add_eos, response_ids), True)])
  return out


def prompt_ids(tokenizer: Tokenizer, record: Mapping[str, Any], *, add_bos: bool | None = None,
               where: str | int | None = None) -> np.ndarray:
  """int32 ids of a prompt record's prompt, ready for generation (GRPO rollouts).

  A string prompt is raw text: [BOS] + encode(prompt), BOS by default (as for
  `preference_features`). A messages-list prompt is rendered with the chat template and its
  generation prompt, so the model continues as the assistant; BOS follows the template.
  """
  kind = "prompt"
  check_mapping(record, kind, where)
  if "prompt" not in record:
    raise error(where, kind, f"missing key 'prompt' (keys: {keys(record)})")
  prompt = record["prompt"]
  if isinstance(prompt, str):
    if not prompt:
      raise error(where, kind, "'prompt' is empty")
    return np.concatenate([_bos_ids(tokenizer, True if add_bos is None else add_bos),
                           tokenizer.encode(prompt)]).astype(np.int32)
  if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, Mapping)):
    raise error(where, kind, f"'prompt' is {type_name(prompt)}; expected a string or a list "
                 f"of messages")
  messages = check_messages({"messages": prompt}, kind, where, key="prompt")
  text = _render(tokenizer, messages, True, where, "the prompt with the generation prompt", kind)
  text, template_bos = _strip_bos_text(tokenizer, text)
  return np.concatenate([_bos_ids(tokenizer, _want_bos(tokenizer, add_bos, template_bos)),
                         _encode(tokenizer, text, _unparsed_specials(tokenizer))]).astype(np.int32)


def record_features(tokenizer: Tokenizer, record: Any, kind: str, *,
                    add_bos: bool | None = None, add_eos: bool | None = None,
                    train_on: str = "assistant",
                    where: str | int | None = None) -> Features | dict[str, Features]:
  """Features of one record of `kind` (see `KINDS` and `RECORD_SHAPES`).

  add_bos/add_eos None take each kind's default: True for "text" and "prompt_completion", as
  documented for "chat" and "preference". `train_on` applies to "chat" only.
  """
  if kind == "text":
    if isinstance(record, Mapping):
      text = string_field(record, "text", kind, where)
    elif isinstance(record, str):
      text = record
    else:
      raise error(where, kind, f"the record is {type_name(record)}")
    return lm_features(tokenizer.encode_document(
        text, add_bos=True if add_bos is None else add_bos,
        add_eos=True if add_eos is None else add_eos))
  if kind == "prompt_completion":
    return prompt_completion_features(
        tokenizer, record, add_bos=True if add_bos is None else add_bos,
        add_eos=True if add_eos is None else add_eos, where=where)
  if kind == "chat":
    return chat_features(tokenizer, record, add_bos=add_bos, add_eos=add_eos, train_on=train_on,
                         where=where)
  if kind == "preference":
    return preference_features(tokenizer, record, add_bos=add_bos, add_eos=add_eos, where=where)
  if kind == "prompt":
    return {"prompt_ids": prompt_ids(tokenizer, record, add_bos=add_bos, where=where)}
  raise ConfigError(f"record kind {kind!r}: unknown; choose one of {', '.join(KINDS)}")


def truncate(features: Mapping[str, Any], max_len: int) -> tuple[dict[str, Any], bool]:
  """(features cut to their first `max_len` positions, whether anything was cut).

  `max_len` counts input/target pairs (train.seq_len): a document of seq_len + 1 tokens fits.
  Nested features (a preference pair) are cut side by side, so their shared prompt stays aligned;
  the flag is True when any side was cut. Cutting keeps the start: a cut inside the prompt leaves
  no weight at all, which the caller should check (`weights.sum() == 0`) and count.
  """
  if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
    raise ValueError(f"truncate: max_len={max_len!r}; expected a positive integer")
  out, cut = {}, False
  for key, value in features.items():
    if isinstance(value, Mapping):
      out[key], side_cut = truncate(value, max_len)
      cut |= side_cut
    else:
      cut |= len(value) > max_len
      out[key] = value[:max_len]
  return out, cut


# --- Chat rendering -------------------------------------------------------------------------------


def _chat_pieces(tokenizer: Tokenizer, messages: list[dict[str, Any]], *, add_bos: bool | None,
                 add_eos: bool | None, train_on: str, where) -> list[_Piece]:
  """The conversation's ids as pieces, trained or not; see `chat_features`."""
  n = len(messages)
  # renders[k]: the text of messages[:k]. Checked for prefix stability before BOS is stripped,
  # so a prefix that only matches once a BOS is removed is still caught.
  renders = [""] + [_render(tokenizer, messages[:k], False, where, f"messages[:{k}]")
                    for k in range(1, n + 1)]
  for k in range(1, n):
    if not renders[k + 1].startswith(renders[k]):
      raise error(where, "chat", f"the chat template of {tokenizer.name} is not prefix-stable: "
                   f"the rendering of messages[:{k}] is not a prefix of that of messages[:{k + 1}] "
                   f"({divergence(renders[k], renders[k + 1])}), so per-turn loss weights cannot "
                   f"be placed; use a template that renders earlier turns the same whatever "
                   f"follows (templates that drop earlier reasoning or restyle the last turn do "
                   f"not)", shape=False)
  full = renders[n]

  # (start, stop, trained) spans of `full`.
  spans = []
  for i, m in enumerate(messages):
    start, stop = len(renders[i]), len(renders[i + 1])
    trained = train_on == "all" or (m["role"] == "assistant" and
                                    (train_on == "assistant" or i == n - 1))
    if trained and train_on != "all":
      header_stop = _assistant_header_stop(tokenizer, messages, i, renders, where)
      spans.append((start, header_stop, False))
      start = header_stop
    spans.append((start, stop, trained))

  template_bos = bool(tokenizer.bos_token) and full.startswith(tokenizer.bos_token)
  if template_bos:
    # The leading BOS text becomes the id below: SentencePiece would encode the text as ordinary
    # pieces, and a BOS added by flag on top of it would double.
    skip = len(tokenizer.bos_token)
    spans = [(max(a, skip), b, t) for a, b, t in spans if b > skip]

  # Merge neighbours of equal weight before encoding, so the text is split only where the weight
  # changes and tokenizes as closely as possible to the whole conversation.
  merged = []
  for a, b, t in spans:
    if b <= a:
      continue
    if merged and merged[-1][2] == t and merged[-1][1] == a:
      merged[-1] = (merged[-1][0], b, t)
    else:
      merged.append((a, b, t))
  specials = _unparsed_specials(tokenizer)
  pieces = [(_bos_ids(tokenizer, _want_bos(tokenizer, add_bos, template_bos)), False)]
  pieces += [(_encode(tokenizer, full[a:b], specials), t) for a, b, t in merged]
  ids = np.concatenate([p for p, _ in pieces])
  pieces.append((_chat_eos_ids(tokenizer, add_eos, ids), True))
  return pieces


def _assistant_header_stop(tokenizer: Tokenizer, messages, i: int, renders, where) -> int:
  """Offset in the full rendering where assistant message i's trained text starts.

  The header is what the generation prompt adds to messages[:i]: exactly what a model is given
  at inference. A template whose generation prompt is missing or is no prefix of the turn falls
  back to the text before the content's first occurrence in the turn; a template that rewrites
  the content (e.g. trims it) then trains on the whole turn, header included.
  """
  start, turn = len(renders[i]), renders[i + 1]
  try:
    prompt = _render(tokenizer, messages[:i], True, where, f"messages[:{i}] with the generation "
                     f"prompt")
  except DataError:  # some templates reject a prefix that does not end with a user turn
    prompt = None
  if prompt is not None and len(prompt) > start and prompt.startswith(renders[i]) \
      and turn.startswith(prompt):
    return len(prompt)
  content = messages[i]["content"]
  found = turn.find(content, start) if content else -1
  return found if found >= 0 else start


def _render(tokenizer: Tokenizer, messages, add_generation_prompt: bool, where, what: str,
            kind: str = "chat") -> str:
  try:
    return render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt)
  except ConfigError as e:
    from jinja2.exceptions import TemplateSyntaxError  # pylint: disable=import-outside-toplevel

    if isinstance(e.__cause__, TemplateSyntaxError):
      raise  # a broken template, not a bad record
    raise error(where, kind, f"rendering {what} failed: {e}", shape=False) from e


def _strip_bos_text(tokenizer: Tokenizer, text: str) -> tuple[str, bool]:
  """(text without a leading BOS text, whether it had one)."""
  bos = tokenizer.bos_token
  if bos and text.startswith(bos):
    return text[len(bos):], True
  return text, False


def _want_bos(tokenizer: Tokenizer, add_bos: bool | None, template_bos: bool) -> bool:
  if add_bos is not None:
    return add_bos
  if tokenizer.chat_template is not None:
    return template_bos  # the template is the model's own convention
  return tokenizer.bos_id is not None  # the default format: like pre-training documents


def _chat_eos_ids(tokenizer: Tokenizer, add_eos: bool | None, ids: np.ndarray) -> np.ndarray:
  if add_eos is None:
    add_eos = (tokenizer.chat_template is None and tokenizer.eos_id is not None
               and not tokenizer.eos_token)
  if add_eos and len(ids) and ids[-1] == tokenizer.eos_id:
    return np.zeros(0, np.int32)
  return _eos_ids(tokenizer, add_eos)


def _unparsed_specials(tokenizer: Tokenizer) -> dict[str, int]:
  """BOS/EOS texts that `encode` does not map to their id (SentencePiece), text -> id.

  Only those: a tokenizer that parses them (HF added tokens) is left to do so itself.
  """
  specials = {}
  for text, token_id in ((tokenizer.bos_token, tokenizer.bos_id),
                         (tokenizer.eos_token, tokenizer.eos_id)):
    if text and token_id is not None and tokenizer.encode(text).tolist() != [token_id]:
      specials[text] = token_id
  return specials


def _encode(tokenizer: Tokenizer, text: str, specials: Mapping[str, int]) -> np.ndarray:
  """encode(text), with the texts in `specials` written as their ids."""
  if not any(s in text for s in specials):
    return tokenizer.encode(text)
  pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
  parts, pos = [], 0
  for m in pattern.finditer(text):
    parts += [tokenizer.encode(text[pos:m.start()]), np.array([specials[m.group()]], np.int32)]
    pos = m.end()
  parts.append(tokenizer.encode(text[pos:]))
  return np.concatenate(parts).astype(np.int32)


# --- Shared helpers -------------------------------------------------------------------------------


def _features(pieces: Sequence[_Piece]) -> Features:
  ids = np.concatenate([np.asarray(p, np.int32).reshape(-1) for p, _ in pieces])
  w = np.concatenate([np.full(np.size(p), float(t), np.float32) for p, t in pieces])
  return {"inputs": ids[:-1], "targets": ids[1:], "weights": w[1:]}


def _bos_ids(tokenizer: Tokenizer, add_bos: bool) -> np.ndarray:
  # encode_document of "" is just the flagged specials, and raises the tokenizer's own
  # ConfigError when one is asked for but missing.
  return tokenizer.encode_document("", add_bos=add_bos, add_eos=False)


def _eos_ids(tokenizer: Tokenizer, add_eos: bool) -> np.ndarray:
  return tokenizer.encode_document("", add_bos=False, add_eos=add_eos)
