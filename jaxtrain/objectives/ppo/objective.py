"""Proximal policy optimization: completions sampled in the loop (one per prompt), scored by the
reward functions, and trained with a value head (the critic on the policy's trunk), GAE
advantages and the clipped policy and value losses (the math: jaxtrain.objectives.ppo.loss; the
rollouts: jaxtrain.objectives.ppo.rollouts).

Rollouts use the grpo group's settings (max_new_tokens, temperature, top_p, reward_fns,
on_reward_error, sample_prompts). A batch of rollouts is train.global_batch_size x
ppo.minibatches prompts; it trains ppo.epochs passes of ppo.minibatches optimizer steps, each
on train.global_batch_size of its rows.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.config import ConfigError
from jaxtrain.models import moe
from jaxtrain.objectives.forward import merge_model, router_terms
from jaxtrain.objectives.grpo import loss as grpo_lib
from jaxtrain.objectives.grpo.objective import GRPO, check_steps_per_rollout
from jaxtrain.objectives.ppo import loss as ppo_lib
from jaxtrain.objectives.ppo import rollouts as ppo_rollouts
from jaxtrain.objectives.ppo.rollouts import ROLLOUT_KEYS

# Metrics of each batch of rollouts, measured before its updates.
ROLLOUT_METRICS = ("reward_mean", "reward_std", "completion_len_mean", "kl", "explained_variance",
                   "advantage_mean", "logprob_mismatch", "generation_share", "reward_errors")


class PPO(GRPO):
  name = "ppo"
  metric_names = ppo_lib.METRIC_NAMES + ROLLOUT_METRICS
  unit = "completions"

  def __init__(self, settings, rollout_settings, vocab_limit: int | None = None):
    super().__init__(rollout_settings, vocab_limit=vocab_limit)
    self.ppo = settings
    self.epochs, self.minibatches = int(settings.epochs), int(settings.minibatches)
    self.num_generations = 1
    # Optimizer steps per batch of rollouts: what GRPO's checks call its iterations.
    self.num_iterations = self.epochs * self.minibatches
    self.epsilon = float(settings.epsilon)
    self.kl_coef = float(settings.kl_coef)
    self.uses_reference = self.kl_coef > 0  # the rollouts' KL penalty reads it

  def check(self, config):
    p, g = self.ppo, self.settings
    if config.data.format != "prompt":
      raise ConfigError(f"train.objective='ppo' with data.format={config.data.format!r}: PPO "
                        f"samples completions of prompts; set data.format='prompt' with JSONL "
                        f"records {{prompt, ...fields for the rewards}}")
    if not config.model.get("value_head", False):
      raise ConfigError("train.objective='ppo' without a value head: PPO's advantages come from "
                        "a critic; set model.value_head=True (a [d_model, 1] head on the "
                        "policy's trunk, started at zero from a language model's weights)")
    if self.epochs < 1 or self.minibatches < 1:
      raise ConfigError(f"ppo.epochs={p.epochs}, ppo.minibatches={p.minibatches}: both must be "
                        f"at least 1")
    if not 0 < p.gamma <= 1 or not 0 <= p.lam <= 1:
      raise ConfigError(f"ppo.gamma={p.gamma}, ppo.lam={p.lam}: need 0 < gamma <= 1 and "
                        f"0 <= lam <= 1 (typical: 1.0 and 0.95)")
    if not 0 < p.epsilon < 1 or p.value_clip <= 0 or p.vf_coef < 0 or p.kl_coef < 0:
      raise ConfigError(f"ppo.epsilon={p.epsilon}, ppo.value_clip={p.value_clip}, ppo.vf_coef="
                        f"{p.vf_coef}, ppo.kl_coef={p.kl_coef}: need 0 < epsilon < 1, "
                        f"value_clip > 0, vf_coef >= 0 and kl_coef >= 0")
    if g.warmup_steps:
      raise ConfigError(f"grpo.warmup_steps={g.warmup_steps} with train.objective='ppo': the "
                        f"supervised warm-up is GRPO's; run SFT first and start PPO from it "
                        f"(checkpoint.init_from)")
    if config.precision.fp8_head:
      raise ConfigError("precision.fp8_head=True with train.objective='ppo': the language-model "
                        "loss only")
    self._check_rollouts(config)
    self._check_mesh_and_steps(config)

  def _check_mesh_and_steps(self, config):
    for axis in ("stage", "context"):
      if config.mesh[axis] > 1:
        raise ConfigError(f"mesh.{axis}={config.mesh[axis]} with train.objective='ppo': the "
                          f"rollouts' decode loop runs over data, fsdp and tensor only")
    check_steps_per_rollout(config, self.num_iterations,
                            f"ppo.epochs x ppo.minibatches = {self.num_iterations} steps per "
                            f"batch of rollouts")

  def describe_row(self, seq_len):
    return f"a PPO row (prompt + completion, {seq_len} tokens)"

  def rows_per_step(self, config) -> int:
    return config.train.global_batch_size

  def describe_rows(self, config):
    return f"{config.train.global_batch_size} prompts"

  def batch_shapes(self, config):
    b, t = self.rows_per_step(config), config.train.seq_len
    shapes = {k: ((b, t), jnp.float32 if k == "loss_mask" else jnp.int32)
              for k in grpo_lib.TOKEN_KEYS}
    shapes.update({k: ((b, t), jnp.float32) for k in ROLLOUT_KEYS})
    if self.replay_routing:
      shapes[grpo_lib.ROUTING] = (self.routing_shape(config, b), jnp.int32)
    return shapes

  def forward_passes(self) -> float:
    """Forward passes over a step's rows beside its forward and backward: per batch of rollouts
    (shared by its epochs x minibatches steps, each on 1/minibatches of its rows) the
    generation, the sampling policy's log-probs and values, and the reference's."""
    per_rollout = 2.0 + (1.0 if self.uses_reference else 0.0)
    return per_rollout / self.epochs

  def flops_note(self):
    return (f" × {1 + self.forward_passes() / 3:.3g} (PPO: generation at full length, the "
            f"rollout's log-probs, values and reference)")

  def loss_sums(self, graphdef, loss_chunk_size, *, training=True):
    p = self.ppo
    epsilon, value_clip, vf_coef = float(p.epsilon), float(p.value_clip), float(p.vf_coef)
    logprobs_of = self.policy_logprobs  # at grpo.temperature, like the rollouts' old log-probs

    def sums(params, frozen, batch, constants, dropout_key):
      del constants
      policy = merge_model(graphdef, params, frozen)
      rows = grpo_lib.in_layout(policy, batch)
      with moe.collect_router_stats() as router_passes:
        logprobs_BT, values_BT = logprobs_of(policy, rows, chunk_size=loss_chunk_size,
                                             dropout_key=dropout_key, with_values=True)
      loss_sum, count, metrics = ppo_lib.ppo_sums(
          logprobs_BT, values_BT, rows["old_logprobs"], rows["old_values"],
          rows["advantages"], rows["returns"], rows["loss_mask"], epsilon=epsilon,
          value_clip=value_clip, vf_coef=vf_coef)
      extra, router_metrics = router_terms(policy, router_passes, count, training=training)
      return loss_sum + extra, count, {**metrics, **router_metrics}
    return (lambda params, frozen, batch: None), sums

  def batch_rows(self, config, model_cfg, per_device):
    t, g, p = config.train, self.settings, self.ppo
    reference = ("none (ppo.kl_coef=0)" if not self.uses_reference else "frozen initial params")
    return [
        ("global batch", f"{t.global_batch_size} prompts × 1 completion × {t.seq_len} tokens "
                         f"(≤ {g.max_new_tokens} generated) per step"),
        ("per-device batch", f"{per_device:g} rows (grad accum {t.grad_accum_steps})"),
        ("objective", f"PPO, epsilon {p.epsilon}, value clip {p.value_clip}, vf_coef "
                      f"{p.vf_coef}, gamma {p.gamma}, lambda {p.lam}, KL {p.kl_coef}; "
                      f"reference: {reference}"),
        ("rollouts", f"{t.global_batch_size * self.minibatches} prompts per batch of rollouts, "
                     f"{self.epochs} epochs × {self.minibatches} minibatches; temperature "
                     f"{g.temperature}, top-p {g.top_p}; rewards "
                     f"{self.describe_rewards()} (on error: {g.on_reward_error})"),
    ]

  def make_feeder(self, config, setup, workdir):
    return ppo_rollouts.PPORollouts(config, setup, self, workdir)
