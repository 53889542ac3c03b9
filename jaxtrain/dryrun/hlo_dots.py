"""The matmuls of a compiled XLA program by operand element types: the evidence that a
low-precision step (precision.matmul) multiplies in FP8 on the target, whichever form its
compiler chose (XLA:GPU puts a dot inside a Triton GEMM fusion or calls cuBLASLt; libtpu turns
dots into `convolution`s).

Each `dot` (or `convolution`) instruction is counted once where it appears in the optimized HLO text (a scanned
layer's body once, not once per layer). Its operands' types are the element types their
defining instructions produce in the same computation (a fusion's parameters included).
"""

from __future__ import annotations

import collections
import re

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*([a-z]\w*)\[")
# libtpu rewrites dots into `convolution`s; XLA:GPU keeps `dot`s (inside GEMM fusions).
_DOT = re.compile(r"\s(?:dot|convolution)\(%([\w.\-]+),\s*%([\w.\-]+)")
FP8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz")


def dot_operand_types(hlo: str) -> collections.Counter:
  """Counter {(lhs element type, rhs element type): dots} of the program's text."""
  counts: collections.Counter = collections.Counter()
  types: dict[str, str] = {}
  for line in hlo.splitlines():
    if _COMPUTATION.match(line):
      types = {}  # names are local to their computation
      continue
    defined = _DEFINITION.match(line)
    if not defined:
      continue
    types[defined.group(1)] = defined.group(2)
    dot = _DOT.search(line)
    if dot:
      counts[(types.get(dot.group(1), "?"), types.get(dot.group(2), "?"))] += 1
  return counts


def block_scaled_dots(hlo: str) -> int:
  """Block-scaled (MXFP8) matmuls: XLA's `scaled-dot` instructions, and the cuDNN block-scaled
  GEMM calls XLA:GPU makes of `jax.nn.scaled_matmul` (jaxtrain/ops/mxfp8.py)."""
  return (len(re.findall(r"\sscaled-dot\(", hlo))
          + len(re.findall(r'custom_call_target="__cudnn\$blockScaledDot"', hlo)))


_HEADER = re.compile(r"^%[\w.\-]+\s*\((.*)\)\s*->")


def block_scaled_matmuls(hlo: str) -> int:
  """The step's block-scaled (MXFP8) products however the compiler computes them: each is a
  computation of two e4m3 operands and their two e8m0 scales (the wrapper XLA keeps around
  `jax.nn.scaled_matmul`), whether its body calls cuDNN's block-scaled GEMM or dequantizes to
  a plain dot."""
  count = 0
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      params = header.group(1)
      count += params.count(": f8e4m3fn[") == 2 and params.count(": f8e8m0fnu[") == 2
  return count


def fp8_dots(counts: collections.Counter) -> tuple[int, int]:
  """(dots with both operands e4m3: the forward's, dots with an e5m2 operand: the backward's)."""
  forward = sum(n for (a, b), n in counts.items() if a == b == "f8e4m3fn")
  backward = sum(n for (a, b), n in counts.items()
                 if "f8e5m2" in (a, b) and {a, b} <= set(FP8_TYPES))
  return forward, backward


def describe(counts: collections.Counter) -> str:
  """'7 e4m3 x e4m3, 14 with e5m2 gradients, 3 in bf16' (the dry run's matmul row)."""
  forward, backward = fp8_dots(counts)
  other = collections.Counter()
  for (a, b), n in counts.items():
    if a not in FP8_TYPES and b not in FP8_TYPES:
      other[a if a == b else f"{a} x {b}"] += n
  parts = [f"{forward} e4m3 x e4m3 (forward)", f"{backward} with an e5m2 gradient (backward)"]
  parts += [f"{n} in {t}" for t, n in sorted(other.items())]
  return ", ".join(parts)
