"""Group relative policy optimization: completions sampled in the loop, scored by reward
functions, trained with the clipped, KL-penalized policy loss (the math:
jaxtrain.objectives.grpo.loss; the rollouts: jaxtrain.objectives.grpo.rollouts).

A step's batch is train.global_batch_size prompts × grpo.num_generations completions, each a row
of train.seq_len tokens (prompt, completion, padding) with the loss on the completion tokens.
Each batch of rollouts trains grpo.num_iterations optimizer steps; with one, the sampling
policy is the trained one and its log-probs are the policy's own, without gradient.

Every batch also carries the sampler's log-probs of its completion tokens
(grpo_lib.SAMPLER_LOGPROBS), and each step reports `logprob_mismatch`: the largest gap between
them and the trainer's log-probs of the same tokens before the update (the loss's own with one
iteration, the old log-probs with several).

Every log-prob, the sampler's and the trainer's (the policy's, the old and the reference's), is
of the distribution the rollouts are drawn from: the softmax of the logits / grpo.temperature
over the tokenizer's ids, before top-p's cut (GRPO.policy_logprobs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.config import REWARD_ERROR_POLICIES, ConfigError
from jaxtrain.data import prompts
from jaxtrain.models import moe
from jaxtrain.objectives.base import Objective, reference_model
from jaxtrain.objectives.forward import merge_model, router_terms
from jaxtrain.objectives.grpo import loss as grpo_lib
from jaxtrain.objectives.grpo import reward_models, rewards
from jaxtrain.objectives.grpo import rollouts
from jaxtrain.parallel.mesh import batch_sharding

# Metrics of the rollouts, measured on the host (jaxtrain.objectives.grpo.rollouts) and logged per
# step beside the loss's own (kl, clip_fraction).
ROLLOUT_METRICS = ("reward_mean", "reward_std", "completion_len_mean", "generation_share",
                   "reward_errors")



def check_steps_per_rollout(config, steps: int, what: str) -> None:
  """train.steps and checkpoint.every_steps must be multiples of the optimizer `steps` one batch
  of rollouts feeds (`what` names that setting): a checkpoint then falls between batches, so a
  resumed run samples the same completions."""
  every = config.checkpoint.every_steps
  if config.train.steps % steps or (every > 0 and every % steps):
    raise ConfigError(f"{what}: train.steps={config.train.steps} and checkpoint.every_steps="
                      f"{every} must be multiples of it (a checkpoint falls between batches of "
                      f"rollouts, so a resumed run samples the same completions)")

class GRPO(Objective):
  name = "grpo"
  metric_names = grpo_lib.METRIC_NAMES + (grpo_lib.LOGPROB_MISMATCH,) + ROLLOUT_METRICS
  unit = "completions"

  def __init__(self, settings, vocab_limit: int | None = None):
    self.settings = settings
    # The tokenizer's vocabulary: the policy's softmax is over it (grpo_lib.token_logprobs).
    self.vocab_limit = vocab_limit
    # The rollouts' sampling temperature: every log-prob the trainer takes is at it
    # (policy_logprobs), as the sampler's are (generate.sampled_logprobs).
    self.temperature = float(settings.temperature)
    self.num_generations = int(settings.num_generations)
    self.num_iterations = int(settings.num_iterations)
    self.epsilon, self.beta = float(settings.epsilon), float(settings.beta)
    # With beta 0 the loss never reads the reference: no frozen copy, no extra forward.
    self.uses_reference = self.beta > 0
    self.replay_routing = bool(settings.get("replay_routing", False))
    # The per-token arrays of a row that the policy's forward passes read.
    self.row_keys = grpo_lib.TOKEN_KEYS + ((grpo_lib.ROUTING,) if self.replay_routing else ())
    # Each reward source's mean is logged beside the total.
    self.metric_names = type(self).metric_names + tuple(
        f"reward_{name}_mean" for name in self.reward_source_names())

  def reward_fn_names(self) -> list[str]:
    return [n.strip() for n in str(self.settings.reward_fns).split(",") if n.strip()]

  def reward_model_specs(self) -> list[reward_models.RewardModelSpec]:
    return reward_models.parse_specs(self.settings.get("reward_models", ""))

  def reward_source_names(self) -> list[str]:
    """The metric names (reward_<name>_mean) of the reward functions, then the models."""
    try:
      specs = self.reward_model_specs()
    except ConfigError:  # check() reports it
      specs = []
    return reward_models.source_names(self.reward_fn_names(), specs)

  def check(self, config):
    g = self.settings
    if config.data.format != "prompt":
      raise ConfigError(f"train.objective='grpo' with data.format={config.data.format!r}: GRPO "
                        f"samples completions of prompts; set data.format='prompt' with JSONL "
                        f"records {{prompt, ...fields for the rewards}}")
    if self.num_generations < 2:
      raise ConfigError(f"grpo.num_generations={g.num_generations}: must be at least 2 (the "
                        f"advantages compare the completions of one prompt with each other)")
    if self.num_iterations < 1:
      raise ConfigError(f"grpo.num_iterations={g.num_iterations}: must be at least 1")
    if not 0 <= g.warmup_steps < config.train.steps:
      raise ConfigError(f"grpo.warmup_steps={g.warmup_steps}: must be in [0, train.steps="
                        f"{config.train.steps}) (supervised steps before the sampled ones)")
    if self.beta < 0 or not 0 < self.epsilon < 1:
      raise ConfigError(f"grpo.beta={g.beta}, grpo.epsilon={g.epsilon}: need beta >= 0 and "
                        f"0 < epsilon < 1 (typical: 0.04 and 0.2)")
    self._check_rollouts(config)
    self._check_mesh_and_steps(config)

  def _check_rollouts(self, config):
    """The rollout settings GRPO and PPO share: sampling, lengths, reward functions."""
    g = self.settings
    if g.temperature <= 0 or not 0 < g.top_p <= 1:
      raise ConfigError(f"grpo.temperature={g.temperature}, grpo.top_p={g.top_p}: rollouts "
                        f"need temperature > 0 (distinct samples) and 0 < top_p <= 1")
    self._check_lengths(config)
    self._check_replay(config)
    if g.on_reward_error not in REWARD_ERROR_POLICIES:
      raise ConfigError(f"grpo.on_reward_error={g.on_reward_error!r}: choose "
                        f"{' or '.join(REWARD_ERROR_POLICIES)}")
    names, specs = self.reward_fn_names(), self.reward_model_specs()
    if not names and not specs:
      raise ConfigError("grpo.reward_fns='' and grpo.reward_models='': name at least one reward "
                        "function as 'module:function' (e.g. "
                        "'jaxtrain.objectives.grpo.rewards:exact_match') or a reward model's "
                        "directory")
    for name in names:
      try:
        rewards.resolve(name)
      except ValueError as e:
        raise ConfigError(f"grpo.reward_fns: {e}") from None
    for spec in specs:  # each names a reward model (its config read, not its weights)
      reward_models.check(spec, str(config.model.param_dtype))

  def _check_replay(self, config):
    if self.replay_routing and not config.moe.num_experts:
      raise ConfigError(f"grpo.replay_routing=True with moe.num_experts="
                        f"{config.moe.num_experts}: routing replay is for a Mixture-of-Experts "
                        f"policy (it replays each token's experts); leave it False for a dense "
                        f"model")

  def policy_logprobs(self, model, rows, *, chunk_size: int, **kwargs):
    """grpo_lib.token_logprobs (kwargs: dropout_key, with_values) under the distribution the
    rollouts were drawn from: softmax(logits / grpo.temperature) over the tokenizer's ids, as
    TRL and verl take it. Every trainer log-prob goes through here (GRPO's and PPO's policy,
    old and reference log-probs), so the ratio's two sides, the policy gradient and the KL
    term are all of that one tempered family; the reference is tempered alike, so beta's KL
    compares the two models' distributions at the temperature they are sampled at. Top-p's
    cut is not modelled (generate.sampled_logprobs says why): the sampler records the same
    tempered, untruncated log-probs."""
    return grpo_lib.token_logprobs(model, rows, chunk_size=chunk_size,
                                   vocab_limit=self.vocab_limit, temperature=self.temperature,
                                   **kwargs)

  def row_shardings(self, mesh) -> dict:
    """{key: sharding} of the per-token arrays of a row the policy's passes read (row_keys):
    [B, T], and the replayed routing [B, T, layers, k], rows over the data-parallel axes."""
    return {k: batch_sharding(mesh, 4 if k == grpo_lib.ROUTING else 2) for k in self.row_keys}

  def routing_shape(self, config, rows: int) -> tuple[int, ...]:
    """[rows, seq_len, num_layers, k] of the replayed routing (grpo_lib.ROUTING)."""
    return (rows, config.train.seq_len, config.model.num_layers,
            config.moe.experts_per_token)

  def _check_lengths(self, config):
    g, t = self.settings, config.train
    positions = config.model.max_position_embeddings
    if g.max_new_tokens < 1:
      raise ConfigError(f"grpo.max_new_tokens={g.max_new_tokens}: must be at least 1")
    if g.max_new_tokens >= positions:
      raise ConfigError(f"grpo.max_new_tokens={g.max_new_tokens}: past the model's "
                        f"{positions} positions (model.max_position_embeddings), with no room "
                        f"for a prompt; lower it")
    if g.max_new_tokens >= t.seq_len:
      raise ConfigError(f"grpo.max_new_tokens={g.max_new_tokens} >= train.seq_len={t.seq_len}: "
                        f"a prompt and its completion share one row of train.seq_len tokens; "
                        f"raise train.seq_len or lower grpo.max_new_tokens")

  def _check_mesh_and_steps(self, config):
    if config.mesh.stage > 1:
      raise ConfigError(f"mesh.stage={config.mesh.stage} with train.objective='grpo': the "
                        f"rollouts' decode loop does not run through pipeline stages; use "
                        f"data, fsdp and tensor")
    if config.mesh.context > 1:
      raise ConfigError(f"mesh.context={config.mesh.context} with train.objective='grpo': "
                        f"rollout rows are short and decode one token at a time; use data, "
                        f"fsdp and tensor")
    check_steps_per_rollout(config, self.num_iterations,
                            f"grpo.num_iterations={self.num_iterations}")

  def describe_row(self, seq_len):
    return f"a GRPO row (prompt + completion, {seq_len} tokens)"

  def rows_per_step(self, config) -> int:
    return config.train.global_batch_size * self.num_generations

  def describe_rows(self, config):
    return (f"{config.train.global_batch_size} prompts × grpo.num_generations="
            f"{self.num_generations}")

  def batch_shapes(self, config):
    b, t = self.rows_per_step(config), config.train.seq_len
    shapes = {k: ((b, t), jnp.float32 if k == "loss_mask" else jnp.int32)
              for k in grpo_lib.TOKEN_KEYS}
    shapes["advantages"] = ((b,), jnp.float32)
    shapes[grpo_lib.SAMPLER_LOGPROBS] = ((b, t), jnp.float32)
    if self.replay_routing:
      shapes[grpo_lib.ROUTING] = (self.routing_shape(config, b), jnp.int32)
    if self.num_iterations > 1:
      shapes[grpo_lib.OLD_LOGPROBS] = ((b, t), jnp.float32)
    return shapes

  def tokens_per_step(self, config):
    return self.rows_per_step(config) * config.train.seq_len

  def forward_passes(self) -> float:
    """Forward passes over a step's rows beside the policy's forward and backward: the
    reference's, and per batch of rollouts (shared by its num_iterations steps) the generation
    and, with several iterations, the sampling policy's log-probs."""
    per_rollout = 1.0 + (1.0 if self.num_iterations > 1 else 0.0)
    return (1.0 if self.uses_reference else 0.0) + per_rollout / self.num_iterations

  def flops_per_step(self, config, model_config=None):
    # A forward pass is 2 of the 6 FLOPs per weight and token.
    return super().flops_per_step(config, model_config) * (1.0 + self.forward_passes() / 3)

  def flops_note(self):
    return (f" × {1 + self.forward_passes() / 3:.3g} (GRPO: reference, generation at full "
            f"length, old log-probs)")

  def loss_sums(self, graphdef, loss_chunk_size, *, training=True):
    epsilon, beta, reuse = self.epsilon, self.beta, self.num_iterations > 1
    logprobs_of = self.policy_logprobs

    def reference_logprobs(params, frozen, batch):
      if not beta:
        return None
      reference = reference_model(graphdef, params, frozen)
      rows = grpo_lib.in_layout(reference, grpo_lib.without_routing(batch))
      return jax.lax.stop_gradient(logprobs_of(reference, rows, chunk_size=loss_chunk_size))

    def sums(params, frozen, batch, ref_logprobs_BT, dropout_key):
      policy = merge_model(graphdef, params, frozen)
      rows = grpo_lib.in_layout(policy, batch)
      with moe.collect_router_stats() as router_passes:  # the policy's pass (an MoE model)
        logprobs_BT = logprobs_of(policy, rows, chunk_size=loss_chunk_size,
                                  dropout_key=dropout_key)
      # One update per batch of rollouts: the sampling policy is this one (ratio 1, gradient
      # of the ratio = gradient of the log-probs).
      old_BT = rows[grpo_lib.OLD_LOGPROBS] if reuse else jax.lax.stop_gradient(logprobs_BT)
      ref_BT = logprobs_BT if ref_logprobs_BT is None else ref_logprobs_BT
      loss_sum, count, metrics = grpo_lib.grpo_sums(
          logprobs_BT, old_BT, jax.lax.stop_gradient(ref_BT), rows["advantages"],
          rows["loss_mask"], epsilon=epsilon, beta=beta)
      # The trainer's log-probs of the sampled tokens before any update: this step's with one
      # iteration, the old ones (computed right after sampling) with several.
      metrics[grpo_lib.LOGPROB_MISMATCH] = grpo_lib.logprob_mismatch(
          old_BT, rows[grpo_lib.SAMPLER_LOGPROBS], rows["loss_mask"])
      extra, router_metrics = router_terms(policy, router_passes, count, training=training)
      return loss_sum + extra, count, {**metrics, **router_metrics}
    return reference_logprobs, sums

  def data_module(self):
    return prompts

  def batch_rows(self, config, model_cfg, per_device):
    t, g = config.train, self.settings
    reference = ("none (grpo.beta=0)" if not self.uses_reference else
                 "the base with adapters off" if model_cfg.peft.lora_rank else "frozen initial params")
    rows = self.rows_per_step(config)
    per_device_rows = per_device * self.num_generations
    return [
        ("global batch", f"{t.global_batch_size} prompts × {g.num_generations} completions = "
                         f"{rows} rows × {t.seq_len} tokens (≤ {g.max_new_tokens} generated)"),
        ("per-device batch", f"{per_device_rows:g} rows (grad accum {t.grad_accum_steps})"),
        ("objective", f"GRPO, epsilon {g.epsilon}, beta {g.beta}, {g.num_iterations} "
                      f"update(s) per rollout batch; reference: {reference}"),
        ("rollouts", f"temperature {g.temperature}, top-p {g.top_p}; rewards "
                     f"{self.describe_rewards()} (on error: {g.on_reward_error})"),
    ]

  def resident_bytes(self, config, mesh) -> int:
    dtype = str(config.model.param_dtype)
    return sum(reward_models.weight_bytes(spec, mesh, dtype) for spec in self.reward_model_specs())

  def describe_rewards(self) -> str:
    models = [f"reward model {s.path}" + (f" x {s.weight:g}" if s.weight != 1 else "")
              for s in self.reward_model_specs()]
    return ", ".join(self.reward_fn_names() + models)

  def make_feeder(self, config, setup, workdir):
    return rollouts.Rollouts(config, setup, self, workdir)
