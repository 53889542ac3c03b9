"""Validation of fine-tuning records: clear `DataError`s naming the record, the problem and
the expected shape (`RECORD_SHAPES`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.data.sources.common import DataError

ROLES = ("system", "user", "assistant")

RECORD_SHAPES = {
    "text": 'a string or {"text": str}',
    "prompt_completion": '{"prompt": str, "completion": str} with a non-empty completion',
    "chat": ('{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]} '
             'ending with a non-empty assistant message'),
    "preference": ('{"prompt": str or [{"role": ..., "content": str}, ...], "chosen": str, '
                   '"rejected": str} with non-empty chosen and rejected'),
    "prompt": ('{"prompt": str or [{"role": ..., "content": str}, ...], ...other fields} '
               '(the other fields go to the reward functions)'),
}


def error(where, kind: str, problem: str, *, shape: bool = True) -> DataError:
  """DataError "<record>: <kind> record: <problem>; expected <shape>"."""
  if where is None:
    name = "record"
  elif isinstance(where, (int, np.integer)):
    name = f"record {where}"
  else:
    name = str(where)
  tail = f"; expected {RECORD_SHAPES[kind]}" if shape else ""
  return DataError(f"{name}: {kind} record: {problem}{tail}")


def type_name(value) -> str:
  # JSON's names, since records come from JSON files.
  names = {dict: "an object", list: "an array", str: "a string", int: "a number",
           float: "a number", bool: "a boolean", type(None): "null"}
  return names.get(type(value), type(value).__name__)


def keys(record: Mapping) -> str:
  return ", ".join(repr(k) for k in list(record)[:10]) or "none"


def check_mapping(record, kind: str, where) -> None:
  if not isinstance(record, Mapping):
    raise error(where, kind, f"the record is {type_name(record)}, not an object")


def string_field(record: Mapping, key: str, kind: str, where) -> str:
  if key not in record:
    raise error(where, kind, f"missing key {key!r} (keys: {keys(record)})")
  value = record[key]
  if not isinstance(value, str):
    raise error(where, kind, f"{key!r} is {type_name(value)}, not a string")
  return value


def check_messages(record, kind: str, where, key: str = "messages") -> list[dict[str, Any]]:
  """The record's messages as plain dicts, after checking their shape."""
  if kind == "chat":
    check_mapping(record, kind, where)
    if "messages" not in record:
      raise error(where, kind, f"missing key 'messages' (keys: {keys(record)})")
  messages = record["messages"]
  if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
    raise error(where, kind, f"{key!r} is {type_name(messages)}, not a list of messages")
  if not messages:
    raise error(where, kind, f"{key!r} is empty")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise error(where, kind, f"{key}[{i}] is {type_name(m)}, not an object")
    for field in ("role", "content"):
      if field not in m:
        raise error(where, kind, f"{key}[{i}] has no {field!r} (keys: {keys(m)})")
    if m["role"] not in ROLES:
      raise error(where, kind, f"{key}[{i}] has role {m['role']!r}; roles are "
                   f"{', '.join(repr(r) for r in ROLES)}")
    if not isinstance(m["content"], str):
      raise error(where, kind, f"{key}[{i}] content is {type_name(m['content'])}, not a string")
    out.append(dict(m))  # extra keys (e.g. "name") pass through to the template
  return out


def check_last_assistant(messages, kind: str, where) -> None:
  last = messages[-1]
  if last["role"] != "assistant":
    raise error(where, kind, f"the last message (messages[{len(messages) - 1}]) is from "
                 f"{last['role']!r}; training conversations must end with the assistant's reply")
  if not last["content"]:
    raise error(where, kind, f"the last message (messages[{len(messages) - 1}]) is an empty "
                 f"assistant reply, so there is nothing to train on")


def divergence(a: str, b: str) -> str:
  """Where two texts first differ, shown briefly for an error message."""
  i = 0
  while i < min(len(a), len(b)) and a[i] == b[i]:
    i += 1
  return f"they differ at character {i}: {a[i:i + 30]!r} vs {b[i:i + 30]!r}"
