"""Direct preference optimization: the policy against a frozen reference on {prompt, chosen,
rejected} pairs, each side a row of train.seq_len + 1 tokens (the math:
jaxtrain.objectives.dpo.loss)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.config import ConfigError
from jaxtrain.data import preference
from jaxtrain.models import moe
from jaxtrain.objectives.base import Objective, reference_model
from jaxtrain.objectives.dpo import loss as dpo_lib
from jaxtrain.objectives.forward import merge_model, router_terms


class PreferencePairs(Objective):
  """What the objectives trained on {prompt, chosen, rejected} pairs share: DPO's batch (both
  responses of a pair, each a row of train.seq_len + 1 tokens) from the preference data."""
  unit = "pairs"

  def row_length(self, seq_len):
    return seq_len + 1  # a prompt and response, next-token shifted inside the loss

  def data_module(self):
    return preference

  def batch_shapes(self, config):
    b, t = config.train.global_batch_size, self.row_length(config.train.seq_len)
    return {k: ((b, t), jnp.float32 if k.endswith("loss_mask") else jnp.int32)
            for k in dpo_lib.BATCH_KEYS}

  def tokens_per_step(self, config):
    return 2 * super().tokens_per_step(config)  # both responses of every pair


class DPO(PreferencePairs):
  name = "dpo"
  metric_names = dpo_lib.METRIC_NAMES
  uses_reference = True

  def __init__(self, beta: float = 0.1):
    self.beta = beta

  def check(self, config):
    if self.beta <= 0:
      raise ConfigError(f"dpo.beta={self.beta}: must be positive (typical: 0.1)")
    if config.data.format != "preference":
      raise ConfigError(f"train.objective='dpo' with data.format={config.data.format!r}: DPO "
                        f"trains on preference pairs; set data.format='preference' with JSONL "
                        f"records {{prompt, chosen, rejected}}")

  def describe_row(self, seq_len):
    return f"a DPO row (train.seq_len + 1 = {self.row_length(seq_len)} tokens)"

  def flops_per_step(self, config, model_config=None):
    # The reference's forward pass adds 2 of the 6 FLOPs per weight and token: x 4/3.
    return super().flops_per_step(config, model_config) * 4 / 3

  def flops_note(self):
    return " × 4/3 (DPO: the reference's forward)"

  def loss_sums(self, graphdef, loss_chunk_size, *, training=True):
    beta = self.beta

    def reference_logprobs(params, frozen, batch):
      return dpo_lib.reference_logprobs(reference_model(graphdef, params, frozen), batch,
                                        chunk_size=loss_chunk_size)

    def sums(params, frozen, batch, reference, dropout_key):
      policy = merge_model(graphdef, params, frozen)
      with moe.collect_router_stats() as router_passes:  # the policy's pass (an MoE model)
        loss_sum, count, metrics = dpo_lib.dpo_sums(policy, reference, batch, beta,
                                                    chunk_size=loss_chunk_size,
                                                    dropout_key=dropout_key)
      extra, router_metrics = router_terms(policy, router_passes, count, training=training)
      return loss_sum + extra, count, {**metrics, **router_metrics}
    return reference_logprobs, sums

  def batch_rows(self, config, model_cfg, per_device):
    t = config.train
    reference = "the base with adapters off" if model_cfg.peft.lora_rank else "frozen initial params"
    return [
        ("global batch", f"{t.global_batch_size} preference pairs × 2 responses × "
                         f"{t.seq_len + 1} tokens"),
        ("per-device batch", f"{per_device:g} pairs (grad accum {t.grad_accum_steps})"),
        ("objective", f"DPO, beta {self.beta}; reference: {reference}"),
    ]
