"""Bytes a compiled XLA program moves between devices per run, by kind of collective, with every
loop body counted once per iteration (hlo_flops.py's parser and weighting: a while body by its
trip count, a conditional by its branch with the most).

Kinds and what their "bytes" are (per device, per instruction; tuple-shaped collectives, which
XLA makes by combining several, summed over their elements):

  all-gather          the gathered result (n times what each device contributes)
  reduce-scatter      the input each device reduces (n times the scattered result it keeps)
  all-reduce          the operand (= the result)
  all-to-all          the operand (= the result: what each device sends and receives in all)
  collective-permute  the operand each device sends (= the result it receives)

n is the size of the instruction's replica groups, in any of the forms XLA prints:
`replica_groups={{0,1,2,3},{4,5,6,7}}` (explicit), `[2,4]<=[8]` (iota: 2 groups of 4),
`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}` (mesh axes: the product of the named axes' sizes, a
sub-axis `'x':(2)4` counting 4), or `{}` (all of the module's devices).

XLA:GPU runs collectives asynchronously, as `<kind>-start` / `<kind>-done` pairs: the start is
counted (its shape holds the operands and the result: `(operand, result)`, or `((operands),
result)`; jax 0.10's all-reduce-start's is the result alone, jax 0.12's `((operands), result)`),
the done not.

`link_bytes` is what each device sends over its link in a ring algorithm, the usual schedule
of NCCL and of TPU collectives over one ring: (n-1)/n of the bytes for an all-gather, a
reduce-scatter and an all-to-all, 2(n-1)/n for an all-reduce (a reduce-scatter, then an
all-gather), all of them for a permute. Dividing by a link's rate gives the time the collectives
need at that rate: an estimate, not a measurement (no latency, contention, or topology).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from jaxtrain.train import hlo_flops

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# The opcodes that carry a collective's bytes: the synchronous form and the async start.
OPCODES = {**{k: k for k in KINDS}, **{f"{k}-start": k for k in KINDS}}

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([\w.\-]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?")


@dataclasses.dataclass(frozen=True)
class KindTotal:
  """One kind of collective over one run of the program, per device."""
  kind: str
  executed: int  # instructions run (a loop body's once per iteration)
  bytes: float  # as the module docstring defines them for the kind
  link_bytes: float  # sent over the device's link in a ring algorithm
  # The sizes of the replica groups among its instructions (none for a permute: device pairs).
  group_sizes: tuple[int, ...]

  def seconds(self, bytes_per_s: float) -> float:
    return self.link_bytes / bytes_per_s


@dataclasses.dataclass(frozen=True)
class HloCollectives:
  """The collectives of one run of a program, per device: one KindTotal per kind it has."""
  kinds: tuple[KindTotal, ...]  # in KINDS order

  @property
  def bytes(self) -> float:
    return sum(k.bytes for k in self.kinds)

  @property
  def link_bytes(self) -> float:
    return sum(k.link_bytes for k in self.kinds)

  @property
  def executed(self) -> int:
    return sum(k.executed for k in self.kinds)

  def seconds(self, bytes_per_s: float) -> float:
    """Time the collectives need at `bytes_per_s` per direction per device (one after the
    other, none overlapped with another): an estimate."""
    return self.link_bytes / bytes_per_s

  def of(self, kind: str) -> KindTotal | None:
    return next((k for k in self.kinds if k.kind == kind), None)


def array_bytes(type_str: str) -> float:
  """Bytes of an HLO type, a tuple's summed over its arrays: `(bf16[4,8]{1,0}, f32[])` -> 68.
  Sub-byte types (s4, f4e2m1fn) count their bits; `pred` one byte."""
  total = 0.0
  for element, dims in _ARRAY.findall(type_str):
    bits = re.match(r"[a-z]+(\d+)", element)
    size = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d)
    total += size * (int(bits.group(1)) if bits else 8) / 8
  return total


def tuple_elements(type_str: str) -> list[str]:
  """The top-level elements of a tuple type, `((a, b), c)` -> ['(a, b)', 'c']; an array type
  is its own one element."""
  text = type_str.strip()
  if not text.startswith("("):
    return [text]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:  # the tuple's closing parenthesis
        parts.append(text[start:i].strip())
        break
    elif ch == "," and depth == 1:
      parts.append(text[start:i].strip())
      start = i + 1
  return [p for p in parts if p]


def group_size(op_text: str, devices: int) -> int:
  """The size of an instruction's replica groups (the largest group, if they differ);
  `devices` for `{}` or no groups (all of the module's devices)."""
  mesh = _MESH.search(op_text)
  if mesh:
    sizes = dict((name, int(size)) for name, size in _MESH_AXIS.findall(mesh.group(1)))
    product = 1
    for axis in filter(None, (a.strip() for a in mesh.group(2).split(","))):
      name, _, sub = _GROUP_AXIS.fullmatch(axis).groups()
      product *= int(sub) if sub else sizes.get(name, 1)
    return product
  iota = _IOTA.search(op_text)
  if iota:
    return int(iota.group(2))
  explicit = _EXPLICIT.search(op_text)
  if explicit:
    groups = re.findall(r"\{([\d,]*)\}", explicit.group(1))
    sizes = [len([d for d in g.split(",") if d]) for g in groups]
    return max(sizes) if sizes and max(sizes) else devices
  return devices


def ring_factor(kind: str, n: int) -> float:
  """The share of a collective's bytes each device sends over its link in a ring of `n`."""
  if kind == "collective-permute":
    return 1.0
  if n <= 1:
    return 0.0  # a group of one moves nothing
  share = (n - 1) / n
  return 2 * share if kind == "all-reduce" else share


def instruction_bytes(opcode: str, type_str: str, n: int) -> float:
  """The bytes (module docstring) of one collective instruction of shape `type_str`."""
  result = type_str
  if opcode.endswith("-start"):
    parts = tuple_elements(type_str)  # (operands, result[, context])
    # XLA 0.10's all-reduce-start is its result alone (a tuple of arrays when combined).
    if len(parts) > 1 and (opcode != "all-reduce-start" or parts[0].startswith("(")):
      result = parts[1]
  size = array_bytes(result)
  return size * n if OPCODES[opcode] == "reduce-scatter" else size


def module_devices(hlo_text: str) -> int:
  """The devices of the module: its `num_partitions` x `replica_count` (1 each when unnamed)."""
  header = hlo_text[:hlo_text.find("\n")] if "\n" in hlo_text else hlo_text
  partitions = re.search(r"\bnum_partitions=(\d+)", header)
  replicas = re.search(r"\breplica_count=(\d+)", header)
  return (int(partitions.group(1)) if partitions else 1) * (
      int(replicas.group(1)) if replicas else 1)


@functools.lru_cache(maxsize=8)
def count(hlo_text: str) -> HloCollectives:
  """The collectives of one run of the entry computation of `compiled.as_text()`, per device."""
  computations, entry = hlo_flops.parse(hlo_text, keep=frozenset(OPCODES))
  devices = module_devices(hlo_text)
  # Per computation and kind: [instructions, bytes, link bytes] of one run of its own lines.
  own: dict[int, dict[str, list[float]]] = {}
  groups: dict[str, set[int]] = {}
  for comp in computations.values():
    for opcode, type_str, op_text in comp.kept:
      kind = OPCODES[opcode]
      n = group_size(op_text, devices)
      size = instruction_bytes(opcode, type_str, n)
      row = own.setdefault(id(comp), {}).setdefault(kind, [0, 0.0, 0.0])
      row[0] += 1
      row[1] += size
      row[2] += size * ring_factor(kind, n)
      groups.setdefault(kind, set()).update([n] if kind != "collective-permute" else [])

  def per_run(kind: str, i: int) -> float:
    return hlo_flops.per_run(computations, entry,
                             lambda c: own.get(id(c), {}).get(kind, (0, 0.0, 0.0))[i])

  totals = []
  for kind in (k for k in KINDS if k in groups):
    executed, size, link = (per_run(kind, i) for i in range(3))
    if executed:
      totals.append(KindTotal(kind, int(executed), size, link, tuple(sorted(groups[kind]))))
  return HloCollectives(tuple(totals))
