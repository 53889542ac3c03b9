"""A streaming safetensors writer for export (interop/hf.py): each file's header is written
first (every shape is known up front), then its tensors one at a time, each produced only when
it is written, so the exporter never holds more than one gathered tensor."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Callable, Iterable

import jax.numpy as jnp
import numpy as np

from jaxtrain.interop.hf_weights import INDEX_FILE, SINGLE_FILE

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclasses.dataclass(frozen=True)
class PendingTensor:
  """A tensor to write: its name, shape, dtype, and a function producing it when its turn comes."""
  name: str
  shape: tuple[int, ...]
  dtype: str  # "float32" | "bfloat16" | "float16"
  produce: Callable[[], np.ndarray]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * (4 if self.dtype == "float32" else 2)


def plan_files(tensors: list[PendingTensor], max_file_bytes: int) -> list[list[PendingTensor]]:
  """Tensors in order, split into files of at most `max_file_bytes` (a larger tensor alone)."""
  files, current, size = [], [], 0
  for t in tensors:
    if current and size + t.nbytes > max_file_bytes:
      files.append(current)
      current, size = [], 0
    current.append(t)
    size += t.nbytes
  if current:
    files.append(current)
  return files


def file_names(num_files: int) -> list[str]:
  if num_files == 1:
    return [SINGLE_FILE]
  return [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]


def write_safetensors(path: str, tensors: Iterable[PendingTensor], *, write: bool = True) -> None:
  """Writes one safetensors file, producing and writing one tensor at a time.

  The header (names, dtypes, shapes, byte offsets) is known before any tensor is produced, so it
  goes first; each tensor is then appended and dropped. With `write=False` the tensors are still
  produced (every process must take part in the gathers) but nothing is written.
  """
  tensors = list(tensors)
  header = {"__metadata__": {"format": "pt"}}
  offset = 0
  for t in tensors:
    header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [offset, offset + t.nbytes]}
    offset += t.nbytes
  header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
  header_bytes += b" " * ((-len(header_bytes)) % 8)  # keep the data 8-byte aligned
  np_dtypes = {"float32": np.dtype("<f4"), "bfloat16": np.dtype(jnp.bfloat16),
               "float16": np.dtype("<f2")}
  f = open(path + ".tmp", "wb") if write else None  # pylint: disable=consider-using-with
  try:
    if f:
      f.write(struct.pack("<Q", len(header_bytes)))
      f.write(header_bytes)
    for t in tensors:
      x = np.ascontiguousarray(t.produce(), dtype=np_dtypes[t.dtype])
      if x.shape != t.shape:
        raise ValueError(f"{t.name}: produced shape {x.shape}, planned {t.shape}")
      if f:
        f.write(x.tobytes())
  finally:
    if f:
      f.close()
  if write:
    os.replace(path + ".tmp", path)  # a file that exists is whole


def write_index(directory: str, files: list[list[PendingTensor]], names: list[str]) -> None:
  index = {"metadata": {"total_size": sum(t.nbytes for group in files for t in group)},
           "weight_map": {t.name: name for group, name in zip(files, names) for t in group}}
  with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
    json.dump(index, f, indent=2)
