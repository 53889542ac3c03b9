"""Dry runs (`python -m jaxtrain.main --dry_run`) in the test process, keeping what they
measured and compiled; the last line's contract."""

import dataclasses
import math
import re
from unittest import mock

from tests.helpers import CliResult, run_cli

# The last line of a dry run, which scripts read (jaxtrain/dryrun/command.py: the contract),
# matched whole.
DRY_RUN_LAST_LINE = re.compile(
    r"^dry_run: target=(?P<target>\S+) compiler=(?P<compiler>gpu|tpu|cpu) "
    r"devices=(?P<devices>\d+) params_gib=(?P<params>\S+) opt_gib=(?P<opt>\S+) "
    r"temp_gib=(?P<temp>\S+) total_gib=(?P<total>\S+) fits=(?P<fits>yes|no)$")


@dataclasses.dataclass
class DryRun:
  """What one `--dry_run` left: the CLI's exit code and report (`cli`), and the figures behind
  them: every Measurement `measure.measure` returned, and every call of `measure.compile_step`
  as ((config, devices, platform), its result: compiled step, setup, abstract state, abstract
  batch, attention note, mesh shape)."""
  cli: CliResult
  measurements: list
  compiles: list


def run_dry_run(*args, devices: int | None = None) -> DryRun:
  """Runs `python -m jaxtrain.main --dry_run ARGS` in this process (run_cli) and keeps what the
  command measured and compiled, so that one compile gives a test both the report and the
  compiled program (a deviceless GPU or TPU compile is not served by the persistent compilation
  cache: a second test of the same program compiles it again)."""
  from jaxtrain.train import measure  # pylint: disable=import-outside-toplevel
  measurements, compiles = [], []
  real_measure, real_compile_step = measure.measure, measure.compile_step

  def measure_spy(*a, **k):
    measurements.append(real_measure(*a, **k))
    return measurements[-1]

  def compile_step_spy(*a, **k):
    compiles.append((a, real_compile_step(*a, **k)))
    return compiles[-1][1]

  with mock.patch.object(measure, "measure", measure_spy), \
       mock.patch.object(measure, "compile_step", compile_step_spy):
    cli = run_cli("--dry_run", *args, devices=devices)
  return DryRun(cli, measurements, compiles)


# Bytes per element of the HLO types a train step's collectives carry (for collectives_by_regex).
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


def _type_bytes(type_text: str) -> int:
  return sum(_ITEMSIZE[t] * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims in re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", type_text))


def collectives_by_regex(hlo: str) -> dict[str, tuple[int, int, int]]:
  """{kind: (instructions executed, bytes, group size)} of an XLA:GPU program's all-gathers,
  reduce-scatters and all-reduces, counted another way than train/hlo_collectives.py, to check
  it: the computations cut out of the whole text by one regex, each weighted by the trip counts
  of the while loops it sits in (a DFS over `body=`/`calls=`/`to_apply=`/`condition=` edges).
  A collective is its `-done` (async: its type the result, the `-start`'s arrays minus that
  result the operands) or the synchronous instruction (its operands' types looked up by name);
  the group size is the ratio of the two (all-gather, reduce-scatter) or the product of the mesh
  axes `replica_groups=mesh[...] {...}` names (all-reduce). No conditionals, permutes or
  all-to-alls (none in the steps checked)."""
  assert "conditional(" not in hlo
  assert not re.search(r"\b(all-to-all|collective-permute)(-start)?\(", hlo)
  comps = dict(re.findall(r"^(?:ENTRY )?%?([\w.\-]+) \([^\n]*\{\n(.*?)^\}$", hlo, re.M | re.S))
  entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
  edges = {name: [] for name in comps}
  for name, body in comps.items():
    for line in body.splitlines():
      trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
      for key, callee in re.findall(r"\b(body|calls|to_apply|condition)=%([\w.\-]+)", line):
        edges[name].append((callee, int(trip.group(1)) if key == "body" and trip else 1))
  weight: dict[str, int] = {}

  def visit(name: str, times: int):
    weight[name] = weight.get(name, 0) + times
    for callee, n in edges.get(name, []):
      visit(callee, times * n)
  visit(entry, 1)
  found: dict[str, list[int]] = {}
  kinds = "all-gather|reduce-scatter|all-reduce"
  for name, body in comps.items():
    lines = re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w-]*)\((.*?)\)(.*)$", body, re.M)
    types = {line[0]: line[1] for line in lines}
    by_name = {line[0]: line for line in lines}
    for _, type_text, opcode, args, attrs in lines:
      sync = re.fullmatch(kinds, opcode)
      done = re.fullmatch(rf"({kinds})-done", opcode)
      if not sync and not done:
        continue
      kind, result = (sync or done).group(1) if done else opcode, _type_bytes(type_text)
      if done:  # the start: its arrays are the operands and the result
        start = by_name[args.lstrip("%")]
        operand, attrs = _type_bytes(start[1]) - result, start[4]
      else:
        operand = sum(_type_bytes(types[a]) for a in re.findall(r"%([\w.\-]+)", args))
      if kind == "all-reduce":
        groups = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs)
        axes = dict(re.findall(r"'(\w+)'=(\d+)", groups.group(1)))
        n = math.prod(int(axes[a]) for a in re.findall(r"'(\w+)'", groups.group(2)))
        size = result
      elif kind == "all-gather":
        n, size = result // operand, result
      else:  # reduce-scatter: the bytes are its input
        n, size = operand // result, operand
      row = found.setdefault(kind, [0, 0, n])
      row[0] += weight.get(name, 0)
      row[1] += weight.get(name, 0) * size
      assert row[2] == n, (kind, row[2], n)
  return {k: tuple(v) for k, v in found.items()}
