"""The trainer's pre-flight memory check: the compiled step against the devices' memory."""

import pytest

from jaxtrain.train import measure
from jaxtrain.train import preflight
from jaxtrain.train.setup import abstract_state, build
from tests.helpers import mesh_of, small_config


@pytest.fixture(scope="module")
def setup_and_state():
  config = small_config()
  setup = build(config, mesh_of((1, 1, 1)))
  return config, setup, measure.state_bytes(abstract_state(setup, config.train.seed))


def _limit(monkeypatch, available):
  monkeypatch.setattr(preflight, "available_memory",
                      lambda devices: preflight.Memory(available, "test device"))


def test_a_step_that_fits_is_returned_compiled(setup_and_state):
  config, setup, _ = setup_and_state
  compiled = preflight.check(config, setup, "configs/x.py")
  assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_state_too_large_is_refused_before_compiling(setup_and_state, monkeypatch):
  config, setup, exact = setup_and_state
  _limit(monkeypatch, exact.on_device - 1)
  monkeypatch.setattr(measure, "compile_setup", lambda *a, **k: pytest.fail("compiled"))
  with pytest.raises(preflight.DoesNotFitError, match="optimizer state alone need") as e:
    preflight.check(config, setup, "configs/x.py")
  assert "\n" not in str(e.value) and "--config=configs/x.py --dry_run" in str(e.value)


def test_temporaries_too_large_are_refused_after_compiling(setup_and_state, monkeypatch):
  config, setup, exact = setup_and_state
  _limit(monkeypatch, exact.on_device + 1)
  with pytest.raises(preflight.DoesNotFitError, match="the train step needs") as e:
    preflight.check(config, setup, "configs/x.py")
  assert "GiB available per test device" in str(e.value)
