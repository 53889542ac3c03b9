"""Matmul FLOPs (and instruction counts: `executed_ops`) of a compiled XLA program, with every
loop body counted once per iteration.

`compiled.cost_analysis()["flops"]` counts the body of a while loop once, whatever its trip
count. A train step with scanned layers, gradient accumulation and a chunked loss is three nested
loops, so XLA's figure misses most of the work (about 1/L of the layers' FLOPs). This module reads
the optimized HLO text instead: FLOPs of every `dot` (2 * output elements * contracted size),
each computation weighted by how often it runs — a while body by its `known_trip_count`, which
XLA records for the counted loops that `lax.scan` produces.

A conditional (`lax.cond`) counts its costliest branch, as if it always ran: context-parallel
attention's tiles above the causal diagonal, which it skips at run time, are counted too.

Only matmuls are counted (the model's, attention included): `dot`s, block-scaled `scaled-dot`s
and cuDNN's block-scaled GEMM calls (MXFP8), and the `convolution`s that libtpu's compiler
rewrites dots into; elementwise work is left out as in the analytic formula
(metrics.flops_per_token). libtpu also drops `known_trip_count` from its loops: the trip count is
then read from the loop condition (`counter < N` against one integer constant), as XLA's own loop
analysis does.

`parse` and `per_run` give other counts the same weighting (hlo_collectives.py: the bytes of the
collectives).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# Element types: f32, bf16, pred, and the FP8 ones (f8e4m3fn, f8e5m2, ...).
_ARRAY = re.compile(r"^[a-z][a-z0-9]*\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(calls|body|to_apply|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
# A conditional's branches: `branch_computations={...}`, or `true_computation=` /
# `false_computation=` for a boolean predicate. One of them runs: counted as the costliest.
_BRANCH = re.compile(r"\b(?:branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_INT_CONSTANT = re.compile(r"^[su]\d+\[\](?:\{[^}]*\})?\s*constant\((\d+)\)")


@dataclasses.dataclass
class HloFlops:
  """Per-device matmul FLOPs of one execution of the program."""
  flops: float
  loops: int  # while loops found
  loops_without_trip_count: int  # counted once: their trip count is unknown to XLA


@dataclasses.dataclass
class _Computation:
  dot_flops: float = 0.0
  ops: dict[str, int] = dataclasses.field(default_factory=dict)  # opcode -> instructions
  calls: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (callee, times)
  choices: list[list[str]] = dataclasses.field(default_factory=list)  # conditionals' branches
  # Loop conditions: the integer constants and whether a `<` compare is among the instructions.
  int_constants: list[int] = dataclasses.field(default_factory=list)
  compares_less: bool = False
  # While loops without a known trip count: (body, condition), resolved once all are parsed.
  open_loops: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  # The instructions whose opcode `_parse` was asked to keep: (opcode, type, rest of the line).
  kept: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)


def _split_type(rest: str) -> tuple[str, str]:
  """('f32[8,4]{1,0}', 'dot(...)...') from an instruction's right-hand side; tuples balanced."""
  if not rest.startswith("("):
    head, _, tail = rest.partition(" ")
    return head, tail
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return rest[:i + 1], rest[i + 1:].lstrip()
  return rest, ""


def _dims(type_str: str) -> list[int] | None:
  match = _ARRAY.match(type_str)
  if not match:
    return None
  return [int(d) for d in match.group(1).split(",") if d]


def _operands(op_text: str) -> list[str]:
  """Operand names of `opcode(%a, %b), attrs`: the %names inside the first parentheses."""
  start = op_text.index("(")
  depth = 0
  for i in range(start, len(op_text)):
    depth += op_text[i] == "("
    depth -= op_text[i] == ")"
    if depth == 0:
      return re.findall(r"%([\w.\-]+)", op_text[start:i])
  return []


def _parse(hlo_text: str, keep: frozenset[str] = frozenset()
           ) -> tuple[dict[str, _Computation], str | None, int, int]:
  """(computations by name, the entry's name, while loops, loops without a trip count)."""
  computations: dict[str, _Computation] = {}
  entry, current, shapes = None, None, {}
  loops = unknown = 0
  for line in hlo_text.splitlines():
    if current is None:
      match = _COMPUTATION.match(line)
      if match and not line.startswith("HloModule"):
        current, shapes = computations.setdefault(match.group(2), _Computation()), {}
        if match.group(1):
          entry = match.group(2)
        # Parameters declared in the signature, e.g. (param_0: f32[8,4], ...).
        for name, type_str in re.findall(r"([\w.\-]+):\s*([a-z]+\d*\[[\d,]*\])", line):
          shapes[name] = _dims(type_str)
      continue
    if line.strip() == "}":
      current = None
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, rest = match.groups()
    type_str, op_text = _split_type(rest)
    shapes[name] = _dims(type_str)
    opcode = op_text.split("(", 1)[0].strip()
    current.ops[opcode] = current.ops.get(opcode, 0) + 1
    if opcode in keep:
      current.kept.append((opcode, type_str, op_text))
    constant = _INT_CONSTANT.match(rest)
    if constant:
      current.int_constants.append(int(constant.group(1)))
    if opcode == "compare" and "direction=LT" in op_text:
      current.compares_less = True
    if opcode == "convolution":
      current.dot_flops += _convolution_flops(shapes, name, op_text)
    if opcode == "custom-call" and _BLOCK_SCALED_CALL in op_text:
      current.dot_flops += _block_scaled_call_flops(shapes, op_text)
    if opcode in ("dot", "scaled-dot"):
      out, operands = shapes[name], _operands(op_text)
      lhs = shapes.get(operands[0]) if operands else None
      contracting = _CONTRACTING.search(op_text)
      if out is not None and lhs is not None and contracting:
        size = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d)
        current.dot_flops += 2.0 * math.prod(out) * size
    times = 1
    if opcode == "while":
      loops += 1
      trip = _TRIP_COUNT.search(op_text)
      if trip:
        times = int(trip.group(1))
      else:
        callees = dict(_CALLEE.findall(op_text))
        condition = re.search(r"condition=%?([\w.\-]+)", op_text)
        if condition and "body" in callees:
          current.open_loops.append((callees["body"].lstrip("%"), condition.group(1)))
          continue  # its body's count is resolved after parsing
        unknown += 1
    if opcode == "conditional":
      branches = [c for target in _BRANCH.findall(op_text)
                  for c in re.findall(r"[\w.\-]+", target.replace("%", " "))]
      if branches:
        current.choices.append(branches)
    for kind, target in _CALLEE.findall(op_text):
      # A while's condition does no matmuls; its body runs `times` times.
      for callee in re.findall(r"[\w.\-]+", target.replace("%", " ")):
        current.calls.append((callee, times if kind == "body" else 1))
  for comp in computations.values():
    for body, condition in comp.open_loops:
      cond = computations.get(condition)
      if cond is not None and cond.compares_less and len(set(cond.int_constants)) == 1:
        comp.calls.append((body, cond.int_constants[0]))
      else:
        unknown += 1
        comp.calls.append((body, 1))
  return computations, entry, loops, unknown


# cuDNN's block-scaled (MXFP8) GEMM, as XLA:GPU calls it: lhs [B, M, K] x rhs [B, N, K].
_BLOCK_SCALED_CALL = 'custom_call_target="__cudnn$blockScaledDot"'


def _block_scaled_call_flops(shapes, op_text: str) -> float:
  operands = _operands(op_text)
  lhs = shapes.get(operands[0]) if len(operands) > 1 else None
  rhs = shapes.get(operands[1]) if len(operands) > 1 else None
  if not lhs or not rhs or len(lhs) != 3 or len(rhs) != 3:
    return 0.0
  return 2.0 * lhs[0] * lhs[1] * rhs[1] * lhs[2]


_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _convolution_flops(shapes, name: str, op_text: str) -> float:
  """2 * multiply-adds of a convolution: per output element, input features x the window taps
  that land on the input rather than its padding.

  libtpu rewrites matmuls with a batch-like dim (the heads of a [D, H, E] projection) into
  convolutions whose window spans that dim over an input of size 1, padded on both sides
  (`window={size=32 pad=31_31 rhs_reversal=1}`): all taps but one read padding, so counting
  the whole window would count those matmuls 32 times over."""
  labels = _DIM_LABELS.search(op_text)
  operands = _operands(op_text)
  out = shapes.get(name)
  if not labels or len(operands) < 2 or out is None:
    return 0.0
  lhs, rhs = shapes.get(operands[0]), shapes.get(operands[1])
  if lhs is None or rhs is None:
    return 0.0
  lhs_labels, rhs_labels, out_labels = labels.groups()
  features = lhs[lhs_labels.index("f")] if "f" in lhs_labels else 1
  groups = re.search(r"feature_group_count=(\d+)", op_text)
  features //= int(groups.group(1)) if groups else 1
  window = _parse_window(op_text)
  spatial = sorted(c for c in rhs_labels if c.isdigit())
  per_output_row = math.prod(out) / max(1, math.prod(out[out_labels.index(d)] for d in spatial))
  taps = 1
  for i, d in enumerate(spatial):
    size = rhs[rhs_labels.index(d)]
    pad_low = window[i] if i < len(window) else 0
    taps *= _valid_taps(lhs[lhs_labels.index(d)], size, out[out_labels.index(d)], pad_low)
  return 2.0 * per_output_row * features * taps


def _parse_window(op_text: str) -> list[int]:
  """The low padding of each spatial dim (the output size accounts for the high one); [] without
  padding (or with strides and dilations, which the matmul rewrites do not use: then every tap
  counts)."""
  found = _WINDOW.search(op_text)
  if not found or "stride" in found.group(1) or "dilate" in found.group(1):
    return []
  pads = re.search(r"pad=([\d_x\-]+)", found.group(1))
  if not pads:
    return []
  return [int(p.split("_")[0]) for p in pads.group(1).split("x")]


def _valid_taps(size_in: int, window: int, size_out: int, pad_low: int) -> int:
  """(output position, window tap) pairs of a stride-1 convolution dim that read the input."""
  count = 0
  for i in range(size_in):  # input i is read by tap j at output o = i + pad_low - j
    first = max(0, i + pad_low - size_out + 1)
    last = min(window - 1, i + pad_low)
    count += max(0, last - first + 1)
  return count


def per_run(computations: dict[str, _Computation], entry: str | None,
            own: Callable[[_Computation], float]) -> float:
  """`own(computation)` summed over one run of `entry`: each computation weighted by how often it
  runs (loop bodies by trip count, a conditional by its costliest branch)."""
  memo: dict[str, float] = {}

  def total(name: str) -> float:
    if name not in memo:
      comp = computations.get(name)
      memo[name] = 0.0 if comp is None else own(comp) + sum(
          times * total(callee) for callee, times in comp.calls) + sum(
              max(total(branch) for branch in branches) for branches in comp.choices)
    return memo[name]

  return total(entry) if entry else 0.0


def parse(hlo_text: str, keep: frozenset[str] = frozenset()
          ) -> tuple[dict[str, _Computation], str | None]:
  """(computations by name, the entry computation's name) of `compiled.as_text()`, for counts
  weighted like the FLOPs (per_run); the instructions whose opcode is in `keep` are kept whole in
  their computation's `kept`, as (opcode, type, the rest of the line): hlo_collectives.py reads
  the collectives so."""
  computations, entry, _, _ = _parse(hlo_text, keep)
  return computations, entry


def count(hlo_text: str) -> HloFlops:
  """Matmul FLOPs of one run of the entry computation of `compiled.as_text()`."""
  computations, entry, loops, unknown = _parse(hlo_text)
  return HloFlops(flops=per_run(computations, entry, lambda c: c.dot_flops), loops=loops,
                  loops_without_trip_count=unknown)


def executed_ops(hlo_text: str, opcode: str) -> int:
  """How many `opcode` instructions (e.g. "all-gather-start") one run of the program executes:
  each counted as often as its computation runs (loop bodies by trip count, a conditional by its
  branch with the most)."""
  computations, entry, _, _ = _parse(hlo_text)
  return int(per_run(computations, entry, lambda c: c.ops.get(opcode, 0)))
