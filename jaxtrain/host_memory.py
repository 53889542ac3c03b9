"""Transparent huge pages for the host allocator: the fix for XLA:CPU's per-step page faults.

XLA:CPU allocates all temporaries of one execution as a single block and frees it when the
execution ends (1.36 GB for the train step of the M shape in benchmarks/cpu_throughput.py).
glibc serves a block that large with a fresh mmap and returns it with munmap, so on every step
the kernel faults the block in again and zeroes it 4 KiB at a time: 260k-350k minor page faults
and 0.7-0.9 s of system time per 3 s step on a 2-vCPU VM. With the glibc tunable
`glibc.malloc.hugetlb=1` (glibc >= 2.35) glibc marks its mappings for transparent huge pages,
so the same block faults in 2 MiB at a time: about 1.3k faults, 0.15-0.3 s of system time, and
a 10-20% faster step (docs/performance.md).

A tunable is read only when a process starts, so `reexec_with_hugepages` restarts the current
command with it set (same PID, arguments, environment otherwise). It runs before JAX is imported,
does nothing where it cannot help (not Linux/glibc, glibc too old, THP disabled, the tunable
already chosen), and JAXTRAIN_HOST_HUGEPAGES=0 turns it off.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
TUNABLES_ENV = "GLIBC_TUNABLES"
OPT_OUT_ENV = "JAXTRAIN_HOST_HUGEPAGES"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_MIN_GLIBC = (2, 35)  # the first release with glibc.malloc.hugetlb


def _tunables(value: str | None) -> dict[str, str]:
  """GLIBC_TUNABLES ("name=value:name=value") as a dict, in order."""
  return dict(e.split("=", 1) if "=" in e else (e, "") for e in (value or "").split(":") if e)


def tunables_with_hugepages(current: str | None) -> str | None:
  """GLIBC_TUNABLES with glibc.malloc.hugetlb=1 appended, or None when `current` already sets
  glibc.malloc.hugetlb (whatever the value: the user's choice stands)."""
  if TUNABLE in _tunables(current):
    return None
  return ":".join([*(e for e in (current or "").split(":") if e), f"{TUNABLE}=1"])


def _glibc_version() -> tuple[int, ...] | None:
  lib, version = platform.libc_ver()
  if lib != "glibc" or not version:
    return None
  try:
    return tuple(int(p) for p in version.split(".")[:2])
  except ValueError:
    return None


def _thp_mode(path: str = _THP_ENABLED) -> str | None:
  """The kernel's transparent-huge-page mode ("always", "madvise", "never"), None if unknown."""
  try:
    with open(path, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1:end] if 0 <= start < end else None


def hugepages_supported() -> bool:
  """Linux with glibc >= 2.35 and THP not disabled: where the tunable takes effect."""
  version = _glibc_version()
  return (sys.platform.startswith("linux") and version is not None and version >= _MIN_GLIBC
          and _thp_mode() in ("always", "madvise"))


def reexec_with_hugepages() -> None:
  """Restarts this command with glibc.malloc.hugetlb=1 unless it is set, unsupported here, or
  turned off (JAXTRAIN_HOST_HUGEPAGES=0). Returns only when nothing needs restarting.

  Call it first thing in a program's entry point (before importing JAX: a restart then costs a
  fraction of a second). The restarted process finds the tunable set and returns at once.
  """
  if os.environ.get(OPT_OUT_ENV, "1") == "0" or not hugepages_supported():
    return
  tunables = tunables_with_hugepages(os.environ.get(TUNABLES_ENV))
  if tunables is None:
    return
  env = dict(os.environ)
  env[TUNABLES_ENV] = tunables
  sys.stdout.flush()
  sys.stderr.flush()
  # sys.orig_argv keeps the interpreter's own options (-m module, -u, -X ...), which sys.argv
  # drops; the interpreter itself is named by its full path.
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe() -> str:
  """One line for the run table: whether this process runs with the tunable, and if not why."""
  entries = _tunables(os.environ.get(TUNABLES_ENV))
  if entries.get(TUNABLE, "0") != "0":
    return f"transparent huge pages for large blocks ({TUNABLE}={entries[TUNABLE]})"
  if os.environ.get(OPT_OUT_ENV) == "0":
    return f"4 KiB pages ({OPT_OUT_ENV}=0)"
  if not hugepages_supported():
    return "4 KiB pages (needs Linux, glibc >= 2.35 and transparent huge pages)"
  return "4 KiB pages (start through `python -m jaxtrain.main` for huge pages)"
