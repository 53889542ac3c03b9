"""Loss-spike reporting and the consecutive-bad-steps limit (host-side health checks)."""

import numpy as np
import pytest

from jaxtrain.train.health import LossSpikeDetector, TrainingHealthError, check_bad_streak


def _decaying_curve(n, seed=0):
  rng = np.random.default_rng(seed)
  steps = np.arange(n)
  return 2.0 + 3.0 * np.exp(-steps / 40) + rng.normal(0, 0.02, n)


def test_a_smooth_decaying_curve_has_no_spikes():
  detector = LossSpikeDetector(sigmas=6.0)
  flagged = [detector.update(float(x)) for x in _decaying_curve(300)]
  assert not any(flagged) and detector.spikes == 0


def test_a_jump_is_reported_once_and_not_folded_into_the_baseline():
  detector = LossSpikeDetector(sigmas=6.0)
  curve = _decaying_curve(100)
  for x in curve:
    detector.update(float(x))
  mean_before = detector.mean
  message = detector.update(float(curve[-1]) + 1.5)
  assert message is not None and message.startswith("loss spike:")
  assert detector.spikes == 1 and detector.mean == mean_before
  assert detector.update(float(curve[-1])) is None  # back to normal


def test_no_verdict_during_warmup_and_off_at_zero_sigmas():
  warm = LossSpikeDetector(sigmas=6.0, warmup=10)
  assert [warm.update(x) for x in [5.0, 1.0, 9.0]] == [None, None, None]
  off = LossSpikeDetector(sigmas=0.0)
  for x in [1.0] * 20 + [100.0]:
    assert off.update(x) is None


def test_non_finite_losses_are_left_to_the_bad_step_counter():
  detector = LossSpikeDetector(sigmas=3.0, warmup=2)
  for x in [1.0, 1.0, 1.0]:
    detector.update(x)
  assert detector.update(float("nan")) is None and detector.update(float("inf")) is None
  assert detector.spikes == 0


def test_bad_streak_limit():
  check_bad_streak(2, step=7, limit=3)  # below the limit: nothing happens
  with pytest.raises(TrainingHealthError, match="3 consecutive steps up to step 9.*no checkpoint"):
    check_bad_streak(3, step=9, limit=3)
