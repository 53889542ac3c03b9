"""The restart with glibc.malloc.hugetlb=1 (jaxtrain/host_memory.py)."""

import os
import subprocess
import sys

import pytest

from jaxtrain import host_memory

_PRINT_TUNABLES = ("from jaxtrain import host_memory; host_memory.reexec_with_hugepages(); "
                   "import os; print(repr(os.environ.get('GLIBC_TUNABLES')))")


def test_tunables_are_appended_and_a_user_choice_stands():
  assert host_memory.tunables_with_hugepages(None) == "glibc.malloc.hugetlb=1"
  assert host_memory.tunables_with_hugepages("") == "glibc.malloc.hugetlb=1"
  assert (host_memory.tunables_with_hugepages("glibc.malloc.arena_max=2")
          == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
  assert host_memory.tunables_with_hugepages("glibc.malloc.hugetlb=0") is None
  assert host_memory.tunables_with_hugepages("a=1:glibc.malloc.hugetlb=2") is None


def test_thp_mode_parses_the_bracketed_choice(tmp_path):
  path = tmp_path / "enabled"
  path.write_text("always [madvise] never\n")
  assert host_memory._thp_mode(str(path)) == "madvise"  # pylint: disable=protected-access
  path.write_text("always madvise [never]\n")
  assert host_memory._thp_mode(str(path)) == "never"  # pylint: disable=protected-access
  assert host_memory._thp_mode(str(tmp_path / "missing")) is None  # pylint: disable=protected-access


def _child_tunables(extra_env):
  env = {k: v for k, v in os.environ.items()
         if k not in (host_memory.TUNABLES_ENV, host_memory.OPT_OUT_ENV)}
  env.update(extra_env)
  out = subprocess.run([sys.executable, "-c", _PRINT_TUNABLES], env=env, check=True,
                       capture_output=True, text=True, timeout=120)
  return out.stdout.strip()


@pytest.mark.skipif(not host_memory.hugepages_supported(),
                    reason="needs Linux, glibc >= 2.35 and transparent huge pages")
def test_a_program_restarts_itself_with_the_tunable_once():
  assert _child_tunables({}) == repr("glibc.malloc.hugetlb=1")
  # The user's other tunables are kept; a restart happens only once (else this would hang).
  assert (_child_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
          == repr("glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"))


def test_opt_out_and_a_chosen_value_keep_the_process_as_started():
  assert _child_tunables({host_memory.OPT_OUT_ENV: "0"}) == repr(None)
  assert (_child_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
          == repr("glibc.malloc.hugetlb=0"))


def test_describe_says_what_this_process_runs_with(monkeypatch):
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  assert "huge pages" in host_memory.describe()
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
  monkeypatch.setenv(host_memory.OPT_OUT_ENV, "0")
  assert host_memory.describe() == "4 KiB pages (JAXTRAIN_HOST_HUGEPAGES=0)"
