"""Dry-run targets: names, deviceless devices, and the real compilers' attention kernels.

The kernel tests compile the tiny config's train step for an H100 (XLA's GPU compiler, from the
CUDA plugin) and a TPU v5p (libtpu) on this CPU-only host, and look for the kernels' custom calls
in the compiled program: the acceptance test that the dry run measures the program the
accelerator would run, not a CPU stand-in. Our Pallas kernels are compiled for tiny.py as Gemma 3
(both layer types in one scanned stack: the windowed and the full kernels), cuDNN's for tiny.py's
Llama; the deviceless GPU offload test reads the cuDNN compile. The compilers come with the dev
extra; a test skips, saying what to install, where one is missing.
"""

import importlib.util
import os
import re

import jax
import pytest

from jaxtrain import compat
from jaxtrain import hardware as targets
from jaxtrain.config import ConfigError, load_config_file
from jaxtrain.dryrun import command
from jaxtrain.parallel.mesh import platform_of_backend
from jaxtrain.train import measure
from tests.dry_run_helpers import DRY_RUN_LAST_LINE, run_dry_run
from tests.helpers import REPO, run_cli, run_main
from tests.moe_helpers import with_changes


@pytest.mark.parametrize("name,compiler,num_devices,chip", [
    ("h100x8", "gpu", 8, "h100"),
    ("h100x64", "gpu", 64, "h100"),
    ("l4x1", "gpu", 1, "l4"),
    ("v5p-8", "tpu", 4, "v5p"),  # Cloud TPU counts v5p cores: 4 megacore chips
    ("v4-8", "tpu", 4, "v4"),
    ("v5e-4", "tpu", 4, "v5e"),  # ... and v5e/v6e chips
    ("v6e-1", "tpu", 1, "v6e"),
    (" H100X8 ", "gpu", 8, "h100"),  # case and spaces as typed
])
def test_parse_target_names(name, compiler, num_devices, chip):
  target = targets.parse(name)
  assert target.name == name.strip().lower()
  assert (target.compiler, target.num_devices, target.chip.key) == (compiler, num_devices, chip)
  assert target.memory_bytes == target.chip.memory_bytes > 10 * targets.GIB


def test_cpu_target_is_this_hosts_devices():
  target = targets.parse("cpu")
  assert target.chip is None and target.compiler == "cpu"
  assert targets.devices(target) == jax.devices("cpu")
  assert target.num_devices == len(jax.devices("cpu"))
  assert targets.compiler_missing(target) is None


@pytest.mark.parametrize("name", ["h100-8", "v5p-6", "tpu", "h100x3", ""])
def test_bad_target_names_are_refused_in_one_line(name):
  with pytest.raises(targets.TargetError) as err:
    targets.parse(name)
  message = str(err.value)
  assert "\n" not in message and repr(name) in message
  if name in ("v5p-6", "h100x3"):  # a known chip in a count it does not come in
    chip = name[:-2]
    assert "comes in counts" in message and f"e.g. {chip}" in message
    assert ("8, 16, 32" if chip == "v5p" else "1, 2, 4, 8, 16") in message
  else:
    assert "valid targets:" in message
    for form in ("h100xN", "a100xN", "v5p-N", "v5e-N", "cpu"):
      assert form in message
  # The command's form: a ConfigError, which main.py prints as one line and exits 2.
  with pytest.raises(ConfigError):
    command.resolve_target(name)


@pytest.mark.parametrize("name,kind", [
    ("h100x8", "NVIDIA H100 80GB HBM3"), ("v5p-8", "TPU v5"), ("v5e-1", "TPU v5 lite"),
    ("rtx4090x1", "NVIDIA GeForce RTX 4090"), ("rtx5090x2", "NVIDIA GeForce RTX 5090"),
    ("a6000x4", "NVIDIA RTX A6000"),
    ("rtxpro6000x8", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition")])
def test_deviceless_devices(name, kind):
  target = targets.parse(name)
  missing = targets.compiler_missing(target)
  if missing is not None:
    pytest.skip(missing)
  devices = targets.devices(target)
  assert len(devices) == target.num_devices
  assert {d.device_kind for d in devices} == {kind}
  assert {platform_of_backend(d.platform) for d in devices} == {target.compiler}
  # The MFU table knows the chip by the name its devices report.
  assert targets.chip_for_device_kind(kind) == (target.chip.name, target.chip.peak_bf16_flops)


@pytest.mark.parametrize("kind,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB",
                                                                      312e12),
    ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v5p", 459e12), ("TPU v4", 275e12),
    ("TPU v6 lite", 918e12)])
def test_chip_for_device_kind(kind, peak):
  assert targets.chip_for_device_kind(kind)[1] == peak


def test_chip_for_unknown_device_kind():
  assert targets.chip_for_device_kind("cpu") is None
  assert targets.chip_for_device_kind("NVIDIA RTX 6000 Ada Generation") is None


def test_every_chip_says_what_its_collectives_travel_over():
  """NVLink on the SXM GPUs, the host's PCIe on the cards without it (one direction of a x16
  link: 31.5 GB/s for 4.0, 63 for 5.0), ICI on the TPUs; the A6000's 2-way bridge beside PCIe."""
  for chip in targets.CHIPS:
    link = chip.interconnect
    assert link.kind == {"tpu": "ici"}.get(chip.compiler, link.kind) and link.bytes_per_s > 0
    assert (link.pcie_lanes > 0) == (chip.compiler == "gpu"), chip.key
  by_key = {c.key: c.interconnect for c in targets.CHIPS}
  assert [k for k, link in by_key.items() if link.nvlink] == ["h100", "h200", "b200", "a100"]
  assert by_key["h100"].bytes_per_s == 450e9  # 900 GB/s bidirectional
  for key, gen, rate in (("l4", 4, 31.5), ("rtx4090", 4, 31.5), ("a6000", 4, 31.5),
                         ("rtx5090", 5, 63.0), ("rtxpro6000", 5, 63.0)):
    link = by_key[key]
    assert (link.kind, link.pcie_gen, link.pcie_lanes) == ("pcie", gen, 16), key
    assert round(link.bytes_per_s / 1e9, 1) == round(link.pcie_bytes_per_s / 1e9, 1) == rate
    assert link.describe().startswith(f"PCIe {gen}.0 x16, {rate} GB/s per direction, no NVLink")
  assert by_key["a6000"].bridge_bytes_per_s == 56.25e9  # 112.5 GB/s bidirectional, pairs only
  assert "NVLink bridge pairs two cards" in by_key["a6000"].describe()
  assert by_key["v5p"].describe() == "ICI, 600 GB/s per direction per chip"


@pytest.mark.parametrize("name,memory_gib,peak,compute_capability", [
    ("rtx4090x1", 23.65, 165.2e12, (8, 9)), ("rtx5090x2", 31.37, 209.5e12, (12, 0)),
    ("a6000x4", 47.54, 154.8e12, (8, 6)), ("rtxpro6000x8", 94.97, 500e12, (12, 0))])
def test_workstation_cards(name, memory_gib, peak, compute_capability):
  """The research box's cards: 1 to 8 in one host, each compiled for its own compute
  capability; FP8 on Ada and Blackwell, none on Ampere."""
  target = targets.parse(name)
  chip = target.chip
  assert (chip.compiler, chip.gpu.compute_capability, chip.peak_bf16_flops) == (
      "gpu", compute_capability, peak)
  assert abs(target.memory_bytes / targets.GIB - memory_gib) < 0.01
  assert chip.counts == (1, 2, 4, 8) and targets.gpu_topology(target).startswith("1x1x")
  assert (chip.peak_fp8_flops > 0) == (chip.key != "a6000")
  assert f"cuda_compute_capability {{ major: {compute_capability[0]} " in (
      targets.gpu_target_config(chip))
  with pytest.raises(targets.TargetError, match=r"comes in counts 1, 2, 4, 8; e\.g\."):
    targets.parse(f"{chip.key}x16")


@pytest.mark.parametrize("name,shape", [
    ("v5p-8", "2x2x1"), ("v5p-16", "2x2x2"), ("v5p-128", "4x4x4"), ("v4-8", "2x2x1"),
    ("v5e-1", "1x1"), ("v5e-4", "2x2"), ("v5e-8", "2x4"), ("v5e-16", "4x4"), ("v6e-256", "16x16")])
def test_tpu_topology(name, shape):
  target = targets.parse(name)
  assert targets.tpu_topology(target) == shape
  dims = [int(d) for d in shape.split("x")]
  assert dims[0] * dims[1] * (dims[2] if len(dims) == 3 else 1) == target.num_devices


@pytest.mark.parametrize("name,shape", [
    ("h100x1", "1x1x1"), ("h100x8", "1x1x8"), ("h100x64", "1x8x8"), ("a100x16", "1x2x8")])
def test_gpu_topology(name, shape):
  assert targets.gpu_topology(targets.parse(name)) == shape


def test_verdict():
  memory = 100 * targets.GIB
  usable = memory * targets.USABLE_FRACTION
  assert targets.verdict(memory, usable).status == "fits"
  assert targets.verdict(memory, usable).headroom_bytes == 0
  assert targets.verdict(memory, usable + 1).status == "tight"
  assert targets.verdict(memory, memory + 1).status == "does not fit"
  assert not targets.verdict(memory, memory + 1).fits


def test_scaled_target():
  assert targets.parse("h100x8").scaled(4).name == "h100x32"
  assert targets.parse("v5p-8").scaled(2).name == "v5p-16"


# --- the real compilers' kernels ---------------------------------------------------------------

# configs/tiny.py as Gemma 3 with every switch of the family in play (helpers.FAMILY_OVERRIDES):
# sliding and full layers alternating in one scanned stack, a 64-token window on the 256-token
# rows, the sliding layers' own RoPE, the softmax scale, the tied head, linear RoPE scaling.
GEMMA3 = {"model.family": "gemma3", "model.sliding_window": 64,
          "model.layer_types": "sliding,full,sliding,full", "model.local_rope_theta": 1e4,
          "model.query_pre_attn_scalar": 24.0, "model.tie_embeddings": True,
          "model.rope_scaling.type": "linear", "model.rope_scaling.factor": 8.0}
# The kernel tests: (target, attention.impl, the kernels' custom call, config changes). The
# Pallas targets compile tiny.py as Gemma 3, whose full layers call the kernels as Llama's do
# (no window) and whose sliding layers add the windowed kernels; cuDNN compiles tiny.py's Llama.
KERNEL_TARGETS = {
    "h100x8": ("pallas", "__gpu$xla.gpu.triton", GEMMA3),  # our Pallas kernels, lowered to Triton
    "v5p-8": ("pallas", "tpu_custom_call", GEMMA3),  # our Pallas kernels, lowered to Mosaic
    "h100x1": ("cudnn", "__cudnn$fmha", {}),  # XLA's cuDNN fused attention
    # The newest compute capability in the table (Blackwell workstation, sm_120): our kernels
    # too. (The RTX PRO 6000 rather than the RTX 5090: jax 0.12's Pallas GPU lowering knows it.)
    "rtxpro6000x1": ("pallas", "__gpu$xla.gpu.triton", {}),
}


def _tiny(target, impl, changes=None):
  """configs/tiny.py for `target` with attention.impl=`impl` and `changes` ({"group.key": value},
  dotted for nested groups): 8 sequences of 256 tokens over an fsdp mesh of all the target's
  devices."""
  config = load_config_file(os.path.join(REPO, "configs", "tiny.py"))
  config.target = target.name
  config.attention.impl = impl
  config.train.global_batch_size = 8
  config.train.seq_len = 256
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, -1, 1
  return with_changes(config, changes or {})


def _needs_compiler(target):
  missing = targets.compiler_missing(target)
  if missing is not None:
    pytest.skip(f"no deviceless compiler for {target.name}: {missing}")


@pytest.fixture(scope="module")
def kernel_dry_run():
  """`--dry_run --dry_run_target=NAME` of tiny.py as KERNEL_TARGETS has it (in this process,
  run_dry_run), with more flags if given: one deviceless compile per module for each, which the
  kernel test and the offload test read (a deviceless compile is not served by the persistent
  compilation cache; a second compile of the same step finds its kernels in XLA's kernel cache)."""
  runs = {}

  def dry_run(name, *flags):
    if (name, flags) not in runs:
      target = targets.parse(name)
      _needs_compiler(target)
      impl, _, changes = KERNEL_TARGETS[name]
      runs[name, flags] = run_dry_run(
          "--config=configs/tiny.py", f"--dry_run_target={name}",
          f"--config.attention.impl={impl}", "--config.train.global_batch_size=8",
          *(f"--config.{key}={value}" for key, value in changes.items()), *flags)
    return runs[name, flags]
  return dry_run


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if changes else name  # both layer types' kernels
    for name, (_, _, changes) in KERNEL_TARGETS.items()])
def test_cli_dry_run_compiles_the_attention_kernel_for_the_target(kernel_dry_run, name):
  """`--dry_run --dry_run_target=NAME` (in this process) compiles once, through
  measure.compile_step; the spies of run_dry_run keep the compiled program and the
  Measurement, so one compile gives the report, the program text and the figures. On the Pallas
  targets, Gemma 3's scanned stack of both layer types: one conditional picks the windowed or the
  full kernel per layer, and both branches hold the kernels, forward and backward."""
  target = targets.parse(name)
  impl, kernel, changes = KERNEL_TARGETS[name]
  run = kernel_dry_run(name)
  proc = run.cli
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert len(run.compiles) == 1 and len(run.measurements) == 1
  (config, _, _), (compiled, setup, _, _, note, mesh_shape) = run.compiles[0]
  m = run.measurements[0]
  # The program of configs/tiny.py as _tiny sets it up for the target (the target itself comes
  # from --dry_run_target, not the config).
  assert config.to_dict() == {**_tiny(target, impl, changes).to_dict(), "target": "cpu"}

  # The command's report: the target's compiler, no XLA:CPU model of it.
  lines = proc.stdout.strip().splitlines()
  match = DRY_RUN_LAST_LINE.match(lines[-1])
  assert match, lines[-1]
  assert (match["target"], match["compiler"], match["devices"], match["fits"]) == (
      name, target.compiler, str(target.num_devices), "yes")
  assert float(match["temp"]) > 0
  kernels_note = {"pallas": "our Pallas kernels", "cudnn": "cuDNN fused attention"}[impl]
  assert f"{kernels_note}, compiled for {target.compiler.upper()}" in proc.stdout
  assert "note:" not in proc.stdout and "emulated" not in proc.stdout

  hlo = compiled.as_text()
  called = re.findall(r'custom_call_target="([^"]+)"', hlo)
  kernels = [c for c in called if c.startswith(kernel)]
  # The forward kernel and the backward pass's (its own kernel or kernels); with both layer
  # types, each branch of the layer's conditional holds its own, forward and backward.
  assert len(kernels) >= (4 if changes else 2), sorted(set(called))
  if changes:
    assert setup.model_cfg.arch.sliding_layers() == (True, False, True, False)
    assert len(re.findall(r"\bconditional\(", hlo)) >= 2  # forward and backward
  other = {"__gpu$xla.gpu.triton", "tpu_custom_call", "__cudnn$fmha"} - {kernel}
  assert not [c for c in called if c.startswith(tuple(other))], sorted(set(called))
  assert setup.model_cfg.runtime.attention_impl == impl
  assert setup.model_cfg.runtime.platform == target.compiler
  assert f"compiled for {target.compiler.upper()}" in note

  assert compiled.memory_analysis().temp_size_in_bytes > 0
  assert m.backend == m.platform == target.compiler
  assert m.num_devices == target.num_devices == mesh_shape.fsdp
  # The temporaries are the compiler's temp allocation, from its buffer assignment (on GPU that
  # is what memory_analysis() says too; libtpu 0.0.42's memory_analysis() says more).
  assert m.breakdown is not None and m.temp == m.breakdown.temp_bytes > 0
  reported = compiled.memory_analysis().temp_size_in_bytes
  assert (m.reported_temp or m.temp) == reported
  assert m.breakdown.temporaries() and "largest temporaries at the memory peak" in proc.stdout
  assert m.params > 0
  # Matmul FLOPs of the compiled step, near the analytic 6N-per-token figure (the attention
  # kernel's own matmuls are not HLO dots; remat is off in the tiny config).
  analytic = measure.analytic_flops_per_step(_tiny(target, impl, changes))
  assert 0.5 < m.flops * m.num_devices / analytic < 1.2


def test_offloaded_optimizer_state_on_a_deviceless_gpu_target_is_counted_in_host_memory(
    kernel_dry_run):
  """A deviceless GPU compile has no host memory space: the moments compile on the device, and
  the figures move their exact bytes to host memory, saying so, as the suggestion does. (The
  plain step is the cuDNN kernel test's.)"""
  plain_run = kernel_dry_run("h100x1")
  offload_run = kernel_dry_run("h100x1", "--config.optim.offload_state=True")
  assert plain_run.cli.returncode == offload_run.cli.returncode == 0, offload_run.cli.stderr
  (plain,), (offload,) = plain_run.measurements, offload_run.measurements
  assert not plain.offload_note and plain.opt_host == 0 and plain.opt_device > 0
  assert offload.opt_device == 0 and offload.opt_host == plain.opt_device
  assert offload.total == plain.total - plain.opt_device
  assert "cannot be compiled for GPU without a device" in offload.offload_note
  assert offload.offload_note in offload_run.cli.stdout


# jax 0.12's Pallas GPU lowering knows cards by name (compat.pallas_gpu_lowering_knows): these two
# workstation cards are not in its table; the RTX 4090 and RTX PRO 6000 are.
UNKNOWN_TO_PALLAS_0_12 = ("NVIDIA GeForce RTX 5090", "NVIDIA RTX A6000")


@pytest.mark.parametrize("changes,instead,why", [
    ({"attention.impl": "pallas"}, "'cudnn', or dry-run rtxpro6000x1 (the same sm_120)", ""),
    # Head dim 192: cuDNN does not take it, so auto would run our kernels; the answer is xla.
    ({"attention.impl": "auto", "model.head_dim": 192}, "'xla', or dry-run rtxpro6000x1",
     "cuDNN takes head dims up to 128, not 192, so auto runs our Pallas kernels"),
    # Pipeline stages turn auto's cuDNN into our kernels (ops.attention.impl_under_stages).
    ({"attention.impl": "auto", "mesh.stage": 2}, "'xla', or dry-run rtxpro6000x1",
     "pipeline stages turn cuDNN into our Pallas kernels"),
    ({"attention.impl": "cudnn"}, None, None),  # cuDNN itself needs no Pallas lowering
])
def test_pallas_kernels_for_a_card_the_lowering_cannot_name_are_refused_in_one_line(
    monkeypatch, changes, instead, why):
  """A deviceless dry run whose step would lower our Pallas kernels for a card this JAX's
  lowering has no entry for stops before compiling: one line, exit 2, what to use instead. On
  jax 0.10 (which lowers for any card) the lowering's answer is jax 0.12's, so both legs check
  the refusal; the real answer is checked where it is jax 0.12's."""
  if compat.jax_version() >= (0, 12, 0):
    assert not any(compat.pallas_gpu_lowering_knows(k) for k in UNKNOWN_TO_PALLAS_0_12)
    assert all(compat.pallas_gpu_lowering_knows(targets.parse(n).chip.description)
               for n in ("h100x1", "rtx4090x1", "rtxpro6000x1", "b200x1", "l4x1"))
  else:
    assert compat.pallas_gpu_lowering_knows(UNKNOWN_TO_PALLAS_0_12[0])
    monkeypatch.setattr(compat, "pallas_gpu_lowering_knows",
                        lambda kind: not kind.startswith(UNKNOWN_TO_PALLAS_0_12))
  config = with_changes(_tiny(targets.parse("rtx5090x1"), "xla"), changes)
  refusal = command._pallas_lowering_refusal(config, targets.parse("rtx5090x1"))
  if instead is None:
    assert refusal is None
    return
  assert refusal.startswith(f"attention.impl={changes['attention.impl']!r} on NVIDIA GeForce "
                            f"RTX 5090 32GB: {why}"), refusal
  assert "Pallas GPU lowering has no entry for this card" in refusal
  assert f"use attention.impl={instead}" in refusal and refusal.endswith("(Python 3.11)")
  # A card the lowering knows, with the same compute capability, is not refused.
  assert command._pallas_lowering_refusal(config, targets.parse("rtxpro6000x1")) is None
  if changes["attention.impl"] == "pallas":  # the command's exit: one line, exit 2
    proc = run_cli("--config=configs/tiny.py", "--dry_run", "--dry_run_target=a6000x2",
                   "--config.attention.impl=pallas")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("config error: attention.impl='pallas' on NVIDIA RTX A6000 48GB: "
                               "jax "), lines[0]
    assert "use attention.impl='cudnn', or dry-run on jax 0.10" in proc.stderr
    assert proc.stdout.strip() == ""


# One unknown target through the real process (the exit path of `python -m jaxtrain.main`), the
# other in this process.
@pytest.mark.parametrize("flag,runner", [("--dry_run_target=nope", run_main),
                                         ("--config.target=nope", run_cli)])
def test_cli_unknown_target_is_one_line_exit_2(flag, runner):
  proc = runner("--config=configs/tiny.py", "--dry_run", flag)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert "'nope'" in proc.stderr and "valid targets" in proc.stderr


def test_missing_compiler_falls_back_to_xla_cpu_and_says_how_to_install(monkeypatch, capsys):
  """Without the CUDA plugin (hidden from find_spec), the command models the target with XLA:CPU
  on as many CPU devices (this process has 8), and its first line says what to install."""
  real_find_spec = importlib.util.find_spec
  hidden = ("jax_plugins.xla_cuda12", "libtpu")
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args, **kwargs: (
      None if name in hidden else real_find_spec(name, *args, **kwargs)))
  target = targets.parse("h100x8")
  missing = targets.compiler_missing(target)
  assert missing is not None and targets.AOT_INSTALL in missing and "CUDA plugin" in missing
  assert "libtpu" in targets.compiler_missing(targets.parse("v5p-8"))

  assert command.main(_tiny(target, "pallas"), None, "h100x8", "configs/tiny.py") == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[0] == f"note: {missing}"
  match = DRY_RUN_LAST_LINE.match(lines[-1])
  assert match, lines[-1]
  assert (match["target"], match["compiler"], match["devices"], match["fits"]) == (
      "h100x8", "cpu", "8", "yes")
  text = "\n".join(lines)
  assert "modelled by blockwise" in text and "ESTIMATE for accelerators" in text


def test_a_step_libtpu_refuses_for_memory_is_measured_from_its_refusal():
  # libtpu's compiler raises RESOURCE_EXHAUSTED where XLA's GPU compiler reports and goes on;
  # the dry run reads the temporaries it asked for and judges the step as not fitting.
  target = targets.parse("v5e-1")
  if targets.compiler_missing(target):
    pytest.skip(targets.compiler_missing(target))
  config = load_config_file(os.path.join(REPO, "configs", "tiny.py"))
  config.target = target.name
  config.train.global_batch_size, config.train.seq_len = 2048, 1024
  config.model.max_position_embeddings = 1024
  m = measure.measure(config, targets.devices(target))
  assert m.backend == "tpu" and m.temp > 100 * targets.GIB
  assert "refused" in m.attention_note
  assert not targets.verdict(target.memory_bytes, m.total).fits


def test_a_compiler_package_without_its_parent_counts_as_missing():
  # Without the CUDA plugin there is no `jax_plugins` package at all: find_spec raises.
  assert targets._installed("no_such_package_here.xla_cuda12") is False
  assert targets._installed("json") is True
