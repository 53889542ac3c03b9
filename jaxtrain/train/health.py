"""Training health: non-finite steps that stop a run, and loss spikes that are reported.

The train step itself skips any update whose loss or gradient is non-finite (see
train_step.make_train_step) and counts consecutive skips in `bad_streak`; this module decides on
the host what to do with those counts and with the logged losses.
"""

from __future__ import annotations

import math


class TrainingHealthError(RuntimeError):
  """Too many consecutive non-finite steps: the run stops, keeping its last checkpoint."""


def check_bad_streak(bad_streak: int, step: int, limit: int, checkpointer=None) -> None:
  """Raises TrainingHealthError once `limit` consecutive updates were skipped."""
  if bad_streak < limit:
    return
  latest = checkpointer.latest_step() if checkpointer else None
  kept = (f"the last checkpoint (step {latest}) is kept in {checkpointer.directory}"
          if latest is not None else "no checkpoint was saved")
  raise TrainingHealthError(
      f"{bad_streak} consecutive steps up to step {step} had a non-finite loss or gradient "
      f"and were skipped (train.max_consecutive_bad_steps={limit}); {kept}. Lower "
      f"optim.learning_rate, check the data, or use float32 compute")


class LossSpikeDetector:
  """Flags a logged loss more than `sigmas` standard deviations above its running mean.

  Mean and variance are exponential moving averages over the logged losses (a window of about
  2/alpha logs), so the slow downward trend of training is tracked while a sudden jump stands
  out. Spikes are not folded into the averages: a run of spikes keeps being reported instead of
  raising the baseline. No verdicts before `warmup` losses were seen (early losses fall fast).
  """

  def __init__(self, sigmas: float, alpha: float = 0.1, warmup: int = 10):
    self.sigmas, self.alpha, self.warmup = sigmas, alpha, warmup
    self.mean, self.var, self.seen, self.spikes = 0.0, 0.0, 0, 0

  def update(self, loss: float) -> str | None:
    """A one-line description when `loss` is a spike, else None."""
    if self.sigmas <= 0 or not math.isfinite(loss):
      return None
    std = math.sqrt(self.var)
    # The 1e-3 relative floor keeps a flat, noise-free curve from flagging rounding.
    threshold = self.mean + self.sigmas * max(std, 1e-3 * abs(self.mean))
    if self.seen >= self.warmup and loss > threshold:
      self.spikes += 1
      return (f"loss spike: {loss:.4f} against a running mean of {self.mean:.4f} "
              f"(std {std:.4f}, threshold {threshold:.4f})")
    if self.seen == 0:
      self.mean = loss
    else:
      delta = loss - self.mean
      self.mean += self.alpha * delta
      self.var = (1 - self.alpha) * (self.var + self.alpha * delta * delta)
    self.seen += 1
    return None
