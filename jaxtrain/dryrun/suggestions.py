"""Config changes that shrink a train step's per-device memory, each with its measured effect.

For a config that does not fit, the dry run lists, cheapest in throughput first:

  optim.state_dtype=bfloat16   Adam moments in half the bytes                        (exact)
  train.grad_accum_steps       per-device microbatch 1, same global batch            (compiled)
    ... with the two optimizer options below on top                                 (compiled)
  optim.offload_state=True     optimizer state in pinned host memory                 (exact)
  model.remat_policy=*_offload what the policy saves, kept in host memory  (compiled; XLA:CPU: estimate)
  model.remat_policy=full      save only layer inputs, recompute the rest            (compiled)
  all of the above together                                                           (compiled)
  ... with mesh.tensor=8       attention and MLP activations split 8 ways            (compiled)
  more devices (fsdp)          params and optimizer state split further              (estimate)

"exact" options change only bytes the dry run knows exactly (optimizer state); "compiled" ones
are compiled like the base config, by the same compiler (the target's own when it is installed),
with exact optimizer bytes on top; estimates say how they were derived. The summary then names,
for each memory size asked about (the target's, or each known chip's when XLA:CPU models an
unnamed accelerator), the first option in this order that fits.

On a PCIe target (workstation cards, L4) each compiled option also carries what it moves over the
link (interconnect.py), and a config with mesh.tensor > 1 gets `layout_alternative`: the same
devices with the tensor axis folded into fsdp, compiled, its collectives and memory beside the
config's own, whether or not the config fits.
"""

from __future__ import annotations

import copy
import dataclasses

from jaxtrain.config import ConfigError
from jaxtrain.dryrun import interconnect
from jaxtrain.hardware import Target, TargetError, format_bytes, verdict
from jaxtrain.train import measure as aot

# What the optimizer state is (optim.name), for the run table's dtypes row and the suggestions.
STATE_NAMES = {"adamw": "Adam moments", "muon": "Muon momentum and Adam moments"}

# name -> device memory in bytes: what the verdicts are for (the target, or every known chip).
Memories = dict[str, float]

_OFFLOADABLE = ("minimal", "save_dots", "save_qkv_proj")


@dataclasses.dataclass
class Option:
  overrides: dict[str, object]  # config key -> value, or {} for more devices
  label: str  # as typed on the command line
  effect: str
  total: float  # device bytes per device
  how: str  # "exact" | "compiled" | "estimate"
  flops: float | None = None  # per device per step, when compiled
  # accelerator name -> (largest microbatch predicted to fit, its train.grad_accum_steps)
  microbatch_fit: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
  measured: aot.Measurement | None = None  # the compile a "compiled" option's figures are of
  collectives: str = ""  # on PCIe: what the compiled step moves over the link (interconnect.py)


def with_overrides(config, overrides: dict[str, object]):
  changed = copy.deepcopy(config)
  for key, value in overrides.items():
    group, name = key.split(".")
    changed[group][name] = value
  return changed


def _microbatch(config, base: aot.Measurement) -> int:
  t = config.train
  return t.global_batch_size // (base.mesh.batch_shards * t.grad_accum_steps)


def options(config, devices, base: aot.Measurement, table: Memories,
            target: Target | None = None) -> list[Option]:
  """Memory-saving changes to `config`, compiling on `devices` those that need a compile (for
  the platform `base` was measured for). `target` names the bigger slices to suggest."""
  found: list[Option] = []
  o, t = config.optim, config.train
  policy = config.model.remat_policy
  moments = base.opt_device  # optimizer state in device memory (moments and step counts)

  if o.state_dtype == "float32" and not o.offload_state:
    found.append(Option({"optim.state_dtype": "bfloat16"}, "optim.state_dtype=bfloat16",
                        f"{STATE_NAMES[o.name]} in bfloat16: -{format_bytes(moments / 2)}",
                        base.total - moments / 2, "exact"))

  microbatch = _microbatch(config, base)
  small = None
  # Under pipeline stages a step keeps every pipeline microbatch's activations (one pass over
  # all of them), so splitting the batch finer saves nothing; remat and state options remain.
  if microbatch > 1 and config.mesh.stage == 1:
    accum = t.grad_accum_steps * microbatch
    overrides = {"train.grad_accum_steps": accum}
    small = aot.measure(with_overrides(config, overrides), devices, base.platform)
    found.append(Option(overrides, f"train.grad_accum_steps={accum}",
                        f"per-device microbatch {microbatch} -> 1, same global batch",
                        small.total, "compiled", small.flops,
                        _largest_microbatch(base, small, microbatch, t.grad_accum_steps,
                                            table), small))
    # The optimizer-state options on top: exact bytes off the compiled microbatch-1 step.
    lean = dict(overrides)
    if o.state_dtype == "float32" and not o.offload_state:
      lean["optim.state_dtype"] = "bfloat16"
      found.append(Option(lean, _label(lean), "microbatch 1, bfloat16 moments",
                          _without_optimizer_bytes(small, lean), "compiled", small.flops,
                          measured=small))
    if not o.offload_state:
      lean = {**lean, "optim.offload_state": True}
      found.append(Option(lean, _label(lean), "microbatch 1, moments in pinned host memory",
                          _without_optimizer_bytes(small, lean), "compiled", small.flops,
                          measured=small))

  if not o.offload_state:
    found.append(Option({"optim.offload_state": True}, "optim.offload_state=True",
                        f"{format_bytes(moments)} of optimizer state to pinned host memory",
                        base.total - moments, "exact"))

  full = None
  if policy != "full":
    overrides = {"model.remat_policy": "full"}
    full = aot.measure(with_overrides(config, overrides), devices, base.platform)
    if policy in _OFFLOADABLE:
      offload = {"model.remat_policy": f"{policy}_offload"}
      if base.backend != "cpu":  # accelerator compilers place the saved values in host memory
        moved = aot.measure(with_overrides(config, offload), devices, base.platform)
        found.append(Option(offload, _label(offload),
                            f"{format_bytes(moved.act_host)} of saved activations in host "
                            f"memory, compute as {policy}", moved.total, "compiled", moved.flops,
                            measured=moved))
      else:  # XLA:CPU keeps them in its one memory: what full remat frees is what moves
        moved_bytes = max(0, base.temp - full.temp)
        found.append(Option(
            offload, _label(offload),
            f"~{format_bytes(moved_bytes)} of saved activations to host memory, compute as "
            f"{policy}; device side as with 'full'", base.total - moved_bytes, "estimate",
            base.flops))
    found.append(Option(overrides, "model.remat_policy=full",
                        "recompute each layer in the backward pass: FLOPs x"
                        + (f"{full.flops / base.flops:.2f}" if base.flops else "n/a"),
                        full.total, "compiled", full.flops, measured=full))

  if len([x for x in found if x.overrides]) > 1:
    # Every option but the offload remat policy (an estimate, and full remat supersedes it).
    overrides: dict[str, object] = {}
    for option in found:
      if not str(option.overrides.get("model.remat_policy", "")).endswith("_offload"):
        overrides.update(option.overrides)
    compiled = _compiled_keys(overrides)
    # Reuse a compile above when the combination changes only what it changed.
    done = {"": base, _label({"model.remat_policy": "full"}): full,
            _label({"train.grad_accum_steps": t.grad_accum_steps * microbatch}): small}
    combined = done.get(_label(compiled)) or aot.measure(with_overrides(config, compiled),
                                                         devices, base.platform)
    found.append(Option(overrides, _label(overrides), "all of the above together",
                        _without_optimizer_bytes(combined, overrides),
                        "compiled" if compiled else "exact", combined.flops,
                        measured=combined if compiled else None))

  if found and not _fits_all(min(x.total for x in found), table):
    tensor = _tensor_parallel(config, devices, base, found[-1])
    if tensor is not None:
      found.append(tensor)
  found.extend(_more_devices(config, base, found, table, target))
  if interconnect.over_pcie(target):  # where tensor parallelism's collectives cost the most
    for option in found:
      if option.measured is not None:
        option.collectives = interconnect.brief(option.measured, target)
  return found


def _compiled_keys(overrides: dict[str, object]) -> dict[str, object]:
  """The overrides that change the compiled program; optimizer-state ones are exact arithmetic."""
  return {k: v for k, v in overrides.items() if not k.startswith("optim.")}


def _without_optimizer_bytes(m: aot.Measurement, overrides: dict[str, object]) -> float:
  """Device total of `m` with the optimizer-state overrides applied (exact bytes)."""
  if overrides.get("optim.offload_state"):
    return m.total - m.opt_device
  if overrides.get("optim.state_dtype") == "bfloat16":
    return m.total - m.opt_device / 2
  return m.total


def _label(overrides: dict[str, object]) -> str:
  return " ".join(f"--config.{k}={v}" if len(overrides) > 1 else f"{k}={v}"
                  for k, v in overrides.items())


def _fits_all(total: float, table: Memories) -> bool:
  return all(verdict(memory, total).fits for memory in table.values())


def _tensor_parallel(config, devices, base: aot.Measurement, best: Option,
                     tensor: int = 8) -> Option | None:
  """`best` with 8-way tensor parallelism carved out of the fsdp axis, per-device microbatch
  kept: attention and MLP activations split 8 ways (the residual stream stays whole)."""
  m, mesh, t = config.model, base.mesh, config.train
  dims = (m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size)
  if (mesh.tensor != 1 or mesh.fsdp % tensor or any(d % tensor for d in dims)
      or mesh.stage > 1):  # under stages the accumulation it re-splits is the pipeline's
    return None
  accum = best.overrides.get("train.grad_accum_steps", t.grad_accum_steps)
  microbatch = t.global_batch_size // (mesh.batch_shards * accum)
  shards = mesh.batch_shards // tensor
  if t.global_batch_size % (shards * microbatch):
    return None
  overrides = {**best.overrides, "mesh.data": mesh.data, "mesh.fsdp": mesh.fsdp // tensor,
               "mesh.tensor": tensor,
               "train.grad_accum_steps": t.global_batch_size // (shards * microbatch)}
  measured = aot.measure(with_overrides(config, _compiled_keys(overrides)), devices,
                         base.platform)
  return Option(overrides, _label(overrides),
                f"the above with tensor parallelism {tensor} (microbatch {microbatch} kept)",
                _without_optimizer_bytes(measured, overrides), "compiled", measured.flops,
                measured=measured)


def _largest_microbatch(base: aot.Measurement, small: aot.Measurement, microbatch: int,
                        accum: int, table: Memories) -> dict[str, tuple[int, int]]:
  """Per accelerator, the largest microbatch (a divisor of the current one) predicted to fit.

  Memory is close to linear in the microbatch (activations) plus a constant (weights, optimizer
  state, gradients); the two compiles (microbatch 1 and the current one) fix the line.
  """
  fit = {}
  for name, memory in table.items():
    best = 0
    for mb in range(1, microbatch):
      if microbatch % mb:
        continue
      total = small.total + (base.total - small.total) * (mb - 1) / (microbatch - 1)
      if verdict(memory, total).fits:
        best = mb
    if best:
      fit[name] = (best, accum * microbatch // best)
  return fit


def _more_devices(config, base: aot.Measurement, found: list[Option], table: Memories,
                  target: Target | None) -> list[Option]:
  """More devices in the fsdp axis, on top of the smallest option, for the memory sizes that
  nothing above fits: parameter and optimizer bytes divide by the factor; the per-device
  microbatch is kept (the global batch grows with the devices)."""
  best = min(found, key=lambda x: x.total) if found else None
  smallest = best.total if best else base.total
  if _fits_all(smallest, table):
    return []
  overrides = best.overrides if best else {}
  opt_bytes = 0 if overrides.get("optim.offload_state") else base.opt_device
  if overrides.get("optim.state_dtype") == "bfloat16":
    opt_bytes /= 2
  state = base.params + opt_bytes
  result = []
  for factor in (2, 4, 8):
    fsdp = int(overrides.get("mesh.fsdp", base.mesh.fsdp)) * factor
    if config.model.d_model % fsdp:
      break
    scaled = {**overrides, "mesh.fsdp": fsdp}
    if target is not None and target.chip is not None:
      try:
        more = f"--dry_run_target={target.scaled(factor).name}"
      except TargetError:  # no such slice or host count
        break
    else:
      more = f"--dry_run_devices={base.num_devices * factor}"
    result.append(Option({}, f"{more} {_label(scaled)}",
                         f"params + optimizer state / {factor}; run it to measure",
                         smallest - state + state / factor, "estimate"))
  return result


def describe(found: list[Option], base: aot.Measurement, table: Memories) -> list[str]:
  """One line per option (total, what fits), then the cheapest fix per memory size."""
  lines = []
  for option in found:
    fits = [name for name, memory in table.items() if verdict(memory, option.total).fits]
    lines.append(f"  {option.label}")
    lines.append(f"      {format_bytes(option.total):>11}  {option.how:<8}  {option.effect}")
    lines.append(f"      fits: {', '.join(fits) if fits else 'none of the table'}")
    if option.collectives:
      lines.append(f"      collectives: {option.collectives}")
    if option.microbatch_fit:
      per = ", ".join(f"{k} {mb}" for k, (mb, _) in option.microbatch_fit.items())
      lines.append(f"      largest microbatch that fits (interpolated): {per}")
  lines.append("")
  lines.append("cheapest change that fits (in the order above):")
  for name, memory in table.items():
    if verdict(memory, base.total).fits:
      continue
    lines.append(f"  {name:<12} {best_change(found, base, name, memory)}")
  return lines


def best_change(found: list[Option], base: aot.Measurement, name: str, memory: float) -> str:
  """The first option in `found` that fits devices of `memory` bytes (named `name`), in words."""
  pick = next((x for x in found if verdict(memory, x.total).fits), None)
  if pick is None:
    smallest = min(x.total for x in found) if found else base.total
    return (f"none of these (the smallest needs {format_bytes(smallest)}, most of it "
            f"activations): shorten train.seq_len")
  if name in pick.microbatch_fit:
    mb, accum = pick.microbatch_fit[name]
    how = "; interpolated between the two compiles" if mb > 1 else ""
    return f"--config.train.grad_accum_steps={accum} (microbatch {mb}{how})"
  label = pick.label if pick.label.startswith("--") else f"--config.{pick.label}"
  return f"{label} ({format_bytes(pick.total)}, {pick.how})"


def layout_alternative(config, devices, base: aot.Measurement,
                       target: Target | None) -> list[str]:
  """On a PCIe target with mesh.tensor > 1: the same devices with the tensor axis folded into
  fsdp, compiled like the base, its collectives and memory next to the base's; [] otherwise.
  The global batch is kept, and train.grad_accum_steps where it still divides it (else the
  largest that does)."""
  mesh, t = base.mesh, config.train
  if not interconnect.over_pcie(target) or mesh.tensor == 1:
    return []
  shards = mesh.batch_shards * mesh.tensor
  accum = next((a for a in range(t.grad_accum_steps, 0, -1)
                if t.global_batch_size % (shards * a) == 0), None)
  lines = ["", f"on PCIe, fsdp instead of tensor (the same {base.num_devices} devices; compiled "
               f"like the above, collectives an ESTIMATE as above):"]
  if accum is None:
    return lines + [f"  not compiled: global batch {t.global_batch_size} does not split over "
                    f"{shards} batch shards"]
  overrides = {"mesh.fsdp": mesh.fsdp * mesh.tensor, "mesh.tensor": 1}
  if accum != t.grad_accum_steps:
    overrides["train.grad_accum_steps"] = accum
  label = " ".join(f"--config.{k}={v}" for k, v in overrides.items())
  try:
    other = aot.measure(with_overrides(config, overrides), devices, base.platform)
  except ConfigError as e:
    return lines + [f"  {label}", f"  not compiled: {e}"]
  if not other.hlo:
    return lines + [f"  {label}", "  not compiled: the compiler refused the program (its memory)"]
  rate = interconnect.link_bytes_per_s(target)
  mine, theirs = interconnect.counted(base), interconnect.counted(other)
  fits = verdict(target.memory_bytes, other.total).status
  seconds = interconnect.format_seconds
  return lines + [
      f"  {label}",
      f"    {format_bytes(theirs.link_bytes):>11} over the link, "
      f"~{seconds(theirs.seconds(rate))} per step; memory {format_bytes(other.total)} "
      f"per device ({fits})",
      f"    against {format_bytes(mine.link_bytes)}, ~{seconds(mine.seconds(rate))} "
      f"with mesh.tensor={mesh.tensor} (above)"
      + (f": {mine.link_bytes / theirs.link_bytes:.2f}x fsdp's bytes" if theirs.link_bytes
         else ""),
  ]
