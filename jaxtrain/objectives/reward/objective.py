"""Reward-model training: a score head on the model (model.score_head, implied here) trained on
{prompt, chosen, rejected} pairs with the Bradley-Terry loss (the math:
jaxtrain.objectives.reward.loss). The batch is DPO's: each side a row of train.seq_len + 1
tokens."""

from __future__ import annotations

from jaxtrain.config import ConfigError
from jaxtrain.models import moe
from jaxtrain.objectives.dpo.objective import PreferencePairs
from jaxtrain.objectives.forward import merge_model, router_terms
from jaxtrain.objectives.reward import loss as reward_lib


class RewardModel(PreferencePairs):
  name = "reward"
  metric_names = reward_lib.METRIC_NAMES

  def __init__(self, settings=None):
    self.margin = float(settings.margin) if settings is not None else 0.0
    self.center_coef = float(settings.center_coef) if settings is not None else 0.0

  def check(self, config):
    if config.data.format != "preference":
      raise ConfigError(f"train.objective='reward' with data.format={config.data.format!r}: a "
                        f"reward model trains on preference pairs; set data.format='preference' "
                        f"with JSONL records {{prompt, chosen, rejected}}")
    if self.margin < 0 or self.center_coef < 0:
      raise ConfigError(f"reward.margin={self.margin}, reward.center_coef={self.center_coef}: "
                        f"both must be >= 0 (0 turns each off)")
    if config.precision.fp8_head:
      raise ConfigError("precision.fp8_head=True with train.objective='reward': a reward model "
                        "has a score head, not the vocabulary head that option takes to FP8")

  def describe_row(self, seq_len):
    return f"a reward-model row (train.seq_len + 1 = {self.row_length(seq_len)} tokens)"

  def loss_sums(self, graphdef, loss_chunk_size, *, training=True):
    del loss_chunk_size  # one score per row: no chunked vocabulary head
    margin, center = self.margin, self.center_coef

    def sums(params, frozen, batch, constants, dropout_key):
      del constants
      model = merge_model(graphdef, params, frozen)
      with moe.collect_router_stats() as router_passes:
        loss_sum, count, metrics = reward_lib.reward_sums(
            model, batch, margin=margin, center_coef=center, dropout_key=dropout_key)
      extra, router_metrics = router_terms(model, router_passes, count, training=training)
      return loss_sum + extra, count, {**metrics, **router_metrics}
    return (lambda params, frozen, batch: None), sums

  def batch_rows(self, config, model_cfg, per_device):
    t = config.train
    extras = [f"margin {self.margin}" if self.margin else "",
              f"centering {self.center_coef}" if self.center_coef else ""]
    extras = ", ".join(e for e in extras if e)
    return [
        ("global batch", f"{t.global_batch_size} preference pairs × 2 responses × "
                         f"{t.seq_len + 1} tokens"),
        ("per-device batch", f"{per_device:g} pairs (grad accum {t.grad_accum_steps})"),
        ("objective", "reward model: Bradley-Terry loss on the score head at each response's "
                      f"last token{'; ' + extras if extras else ''}"),
    ]
