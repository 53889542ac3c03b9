"""How the loop learns it must stop: its own signal handlers in a single process, JAX's
preemption sync point (shared by every process) in a multi-process run."""

import os
import signal

from jax.experimental import multihost_utils

from jaxtrain.train import loop as trainer


def test_single_process_stops_on_sigterm_and_restores_handlers():
  before = signal.getsignal(signal.SIGTERM)
  with trainer._StopOnSignal(multi_process=False) as stop:  # pylint: disable=protected-access
    assert not stop.poll(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.poll(2) and stop.signal_name == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is before


def test_multi_process_follows_the_preemption_sync_point(monkeypatch):
  sync_step = 7
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                      lambda step: step == sync_step)
  before = signal.getsignal(signal.SIGTERM)
  with trainer._StopOnSignal(multi_process=True) as stop:  # pylint: disable=protected-access
    # SIGTERM belongs to JAX's preemption service there: no handler of ours is installed.
    assert signal.getsignal(signal.SIGTERM) is before
    assert [stop.poll(s) for s in range(5, 9)] == [False, False, True, True]
    assert stop.signal_name == "the preemption notice"


def test_multi_process_without_the_preemption_service_warns_and_goes_on(monkeypatch, capsys):
  def disabled(step):
    raise RuntimeError("Preemption sync manager has not been initialized.")
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", disabled)
  stop = trainer._StopOnSignal(multi_process=True)  # pylint: disable=protected-access
  assert not stop.poll(1) and not stop.poll(2)
  assert capsys.readouterr().out.count("no preemption sync point") == 1
