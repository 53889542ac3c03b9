"""Where a compiled step's device memory goes: the buffers live at its peak, largest first.

The compiler decides every buffer's place and lifetime (its buffer assignment) and finds the
point of the program where the most bytes are live. With `--xla_dump_to` (here a compile
option, `compile_options`) it writes both, for every compiler we target (libtpu, XLA's GPU and
CPU compilers):

  *after_optimizations-buffer-assignment.txt  allocations (parameters, the temp allocation,
                                              outputs), and each value's offset and size in one
  *after_optimizations-live-range.txt         "Live ranges at N (peak):" the values live there
  *after_optimizations.txt                    the optimized HLO, whose `op_name` metadata names
                                              the JAX operation (or parameter) behind each value

`read` joins them: the peak's live values, with values that share one buffer (a loop's state
and the buffer it runs in, say) counted once, each named by what made it. `temp_bytes` is the
temp allocation the runtime makes for the program, from the same buffer assignment.

Why not only `compiled.memory_analysis()`: it gives totals, not what they are made of; and
libtpu 0.0.42's `temp_size_in_bytes` is larger than the temp allocation of its own buffer
assignment (Llama 3 8B on v5p-8: 18.14 GiB reported, 13.98 GiB allocated; the heap simulator's
peak, `peak_memory_in_bytes`, agrees with the allocation, and newer libtpu (0.0.52) reports
the allocation). The dry run takes the allocation for TPU targets (measure.py).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_PEAK_HEADER = re.compile(r"^\s*Live ranges at \d+ \(peak\):")
_PEAK_VALUE = re.compile(r"^\s+(\S+): (\d+) bytes")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9_\-]*)\((?:%|\)|\d)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^{}]*\}")
# Values whose instruction only forwards a buffer made elsewhere: a loop body's parameter, a
# tuple element. Another value of the same buffer names it better.
_FORWARDING = ("parameter", "get-tuple-element", "tuple", "bitcast", "while", "call",
               "conditional", "copy-start", "copy-done")


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One buffer live at the peak."""
  size: int
  shape: str  # without layout, e.g. "bf16[32,1024,14336]"
  instruction: str  # the HLO instruction that defines it, e.g. "convert.177"
  opcode: str  # e.g. "convert", "fusion", "parameter"
  source: str  # the JAX operation or argument path behind it ("" when the compiler made it)
  kind: str  # "argument" (the state and batch), "temporary", or "output"


@dataclasses.dataclass(frozen=True)
class Breakdown:
  temp_bytes: int  # the temp allocation(s) in device memory (default memory space)
  peak_bytes: int  # live at the peak, arguments included, each buffer once
  buffers: tuple[Buffer, ...]  # live at the peak, largest first

  def temporaries(self) -> list[Buffer]:
    return [b for b in self.buffers if b.kind != "argument"]


def compile_options(dump_dir: str) -> dict[str, object]:
  """The compile options that make the compiler write what `read` needs into `dump_dir`.

  A persistent compilation cache (JAX_COMPILATION_CACHE_DIR) would serve an identical program
  from an earlier compile, which writes no dump: JAX leaves the dump flags out of its cache key.
  `xla_dump_large_constants` (its default value; it changes only how dumps print constants) is
  part of the key, so a compile with these options never takes a plain compile's entry; the
  caller keeps it from writing one of its own (measure.py), so it never takes an earlier one's.
  """
  return {"xla_dump_to": dump_dir, "xla_dump_large_constants": False}


def read(dump_dir: str, module: str = "jit_train_step") -> Breakdown | None:
  """The breakdown of the module named `module` in `dump_dir`; None if the compiler wrote
  nothing for it there (e.g. the executable came from a compilation cache)."""
  assignment = _newest(dump_dir, module, "after_optimizations-buffer-assignment.txt")
  live_range = _newest(dump_dir, module, "after_optimizations-live-range.txt")
  hlo = _newest(dump_dir, module, "after_optimizations.txt")
  if not (assignment and live_range and hlo):
    return None
  with open(assignment, encoding="utf-8") as f:
    allocations, values = _parse_assignment(f)
  with open(live_range, encoding="utf-8") as f:
    peak_names = _parse_peak(f)
  with open(hlo, encoding="utf-8") as f:
    instructions = _parse_instructions(f)
  temp = sum(size for size, attrs in allocations.values()
             if "preallocated-temp" in attrs and "color" not in attrs)
  buffers = _peak_buffers(peak_names, allocations, values, instructions)
  return Breakdown(temp_bytes=temp, peak_bytes=sum(b.size for b in buffers),
                   buffers=tuple(buffers))


def _newest(dump_dir: str, module: str, suffix: str) -> str | None:
  """The dump file of the last-compiled module named `module` (module_NNNN.<name>.*)."""
  found = [p for p in glob.glob(os.path.join(glob.escape(dump_dir), f"module_*.{module}.*"))
           if p.endswith(suffix)]
  return max(found) if found else None


def _parse_assignment(lines):
  """({allocation: (size, attributes)}, {value name: (allocation, offset, size, shape)})."""
  allocations: dict[int, tuple[int, str]] = {}
  values: dict[str, tuple[int, int, int, str]] = {}
  current = None
  for line in lines:
    line = line.rstrip("\n")
    if m := _ALLOCATION.match(line):
      current = int(m.group(1))
      allocations[current] = (int(m.group(2)), m.group(3))
    elif current is not None and (m := _VALUE.match(line)):
      values[_value_key(m.group(1))] = (current, int(m.group(3)), int(m.group(2)),
                                        _LAYOUT.sub("", m.group(4)))
    elif not line.startswith(" "):
      current = None  # the allocation's value list has ended
  return allocations, values


def _parse_peak(lines) -> list[str]:
  names, inside = [], False
  for line in lines:
    if _PEAK_HEADER.match(line):
      inside = True
    elif inside:
      m = _PEAK_VALUE.match(line)
      if not m:
        break
      names.append(_value_key(m.group(1)))
  return names


def _parse_instructions(lines) -> dict[str, tuple[str, str]]:
  """{instruction name: (opcode, source)}: the source is the op_name metadata; for what the
  compiler added (no metadata), "<opcode> of <its first named operand's source>"."""
  found, operands = {}, {}
  for line in lines:
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    rest = m.group(2)
    opcode = _OPCODE.search(rest)
    op_name = _OP_NAME.search(rest)
    found[m.group(1)] = (opcode.group(1) if opcode else "",
                         op_name.group(1).replace("\\'", "'") if op_name else "")
    if opcode:
      operands[m.group(1)] = _OPERAND.findall(rest[opcode.end() - 1:].split(")", 1)[0])
  def origin(name, depth=0):
    """The op_name behind `name`: its own, or (for what the compiler added) its first
    operand's, followed back through the compiler's copies and casts."""
    opcode, op_name = found.get(name, ("", ""))
    if op_name or depth > 8:
      return op_name
    return next((o for o in (origin(x, depth + 1) for x in operands.get(name, ())) if o), "")
  named = {}
  for name, (opcode, op_name) in found.items():
    source = op_name or origin(name)
    if not source and opcode == "parameter":
      source = "loop state"  # a nested computation's parameter: what a loop carries
    named[name] = (opcode, source if op_name or not source or opcode == "parameter"
                   else f"{opcode} of {source}")
  return named


def _value_key(name: str) -> str:
  """Value names as the buffer assignment writes them: `fusion.150{1}`, `param.44`."""
  return name[:-2] if name.endswith("{}") else name


def _instruction_of(value: str) -> str:
  return value.split("{", 1)[0]


def _peak_buffers(peak_names, allocations, values, instructions) -> list[Buffer]:
  """The peak's values grouped by the buffer they occupy, each named by its most telling
  value, largest first."""
  groups: dict[tuple[int, int], list[str]] = {}
  for name in peak_names:
    if name in values:
      allocation, offset, _, _ = values[name]
      groups.setdefault((allocation, offset), []).append(name)
  buffers = []
  for (allocation, _), names in groups.items():
    def rank(name):
      opcode, op_name = instructions.get(_instruction_of(name), ("", ""))
      return (opcode in _FORWARDING, not op_name)
    best = min(names, key=rank)
    size = max(values[n][2] for n in names)
    opcode, op_name = instructions.get(_instruction_of(best), ("", ""))
    attrs = allocations[allocation][1]
    kind = ("argument" if "parameter" in attrs else
            "temporary" if "preallocated-temp" in attrs else "output")
    buffers.append(Buffer(size=size, shape=values[best][3], instruction=_instruction_of(best),
                          opcode=opcode, source=op_name, kind=kind))
  return sorted(buffers, key=lambda b: -b.size)


_STATE_PATH = re.compile(r"state\.(\w+)((?:\[[^\]]*\])*)(?:\.value)?")


def describe_source(source: str) -> str:
  """An op_name for a table: `forward`/`backward` for JAX's jvp/transpose, argument paths
  dotted (`params.layers.mlp.w_up_DF`), the jit wrapper dropped."""
  if not source:
    return "(made by the compiler)"
  source = re.sub(r"(^|of )jit\([^)]*\)/", r"\1", source)
  source = source.replace("transpose(jvp())", "backward").replace("jvp()", "forward")
  return _STATE_PATH.sub(lambda m: m.group(1) + "".join(
      "." + k.strip("'\"") for k in re.findall(r"\[([^\]]*)\]", m.group(2))), source)
