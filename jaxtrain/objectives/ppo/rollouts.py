"""PPO's rollouts: the GRPO feeder (jaxtrain.objectives.grpo.rollouts) with one completion per
prompt, and what PPO adds before its updates.

Every ppo.epochs x ppo.minibatches steps a batch of rollouts is drawn: train.global_batch_size x
ppo.minibatches prompts (the data stream's next minibatches batches), one completion each,
scored by the reward functions on the host. One jitted pass over the batch (`_jit_prepare`)
then computes, with the weights that sampled it, the log-probs and values of every completion
token, the reference's log-probs (the KL penalty), the token rewards, GAE advantages (whitened
over the batch) and returns. The rows come back to the host; each step trains on
train.global_batch_size of them: epoch e visits them in an order drawn from (train.seed, the
batch's first step, e), minibatch j takes the j-th slice of it. A checkpoint falls only between
batches of rollouts (GRPO's check on train.steps and checkpoint.every_steps), so a resumed run
samples and shuffles exactly as an uninterrupted one. Each process keeps its own prompts' rows.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.objectives.base import reference_model
from jaxtrain.objectives.feeders import to_global_batch
from jaxtrain.objectives.forward import merge_model
from jaxtrain.objectives.grpo import loss as grpo_lib
from jaxtrain.objectives.grpo.rollouts import Rollouts, local_rows
from jaxtrain.objectives.ppo import loss as ppo_lib
from jaxtrain.parallel.mesh import batch_sharding, replicated

# The training batch built from a batch of rollouts: the language-model keys and, per token
# [B, T], the sampling policy's log-probs and values, the whitened advantages and the returns.
ROLLOUT_KEYS = ("old_logprobs", "old_values", "advantages", "returns")


class PPORollouts(Rollouts):
  """The PPO feeder: a batch of rollouts every ppo.epochs x ppo.minibatches steps."""

  def __init__(self, config, setup, objective, workdir: str):
    super().__init__(config, setup, objective, workdir)
    p = config.ppo
    self.epochs, self.minibatches = objective.epochs, objective.minibatches
    self.rows_per_step = int(config.train.global_batch_size) // jax.process_count()
    self.gamma, self.lam, self.kl_coef = float(p.gamma), float(p.lam), float(p.kl_coef)
    self._prepare = self._jit_prepare()
    self._rollout_step = 0

  def _jit_prepare(self):
    setup, chunk = self.setup, self.loss_chunk_size
    graphdef, gamma, lam, kl_coef = setup.graphdef, self.gamma, self.lam, self.kl_coef
    # Every log-prob at grpo.temperature over the tokenizer's ids: the distribution sampled from.
    logprobs_of = self.objective.policy_logprobs

    def prepare(params, frozen, batch, sampler_BT, rewards_B):
      # Layout order: PPO runs without a context axis (its config check), so it is the rows'.
      policy = merge_model(graphdef, params, frozen)
      old_BT, values_BT = logprobs_of(policy, batch, chunk_size=chunk, with_values=True)
      mask_BT = batch["loss_mask"]
      if kl_coef:
        reference = reference_model(graphdef, params, frozen)
        ref_BT = logprobs_of(reference, grpo_lib.without_routing(batch), chunk_size=chunk)
      else:
        ref_BT = old_BT
      rewards_BT = ppo_lib.token_rewards(rewards_B, old_BT, ref_BT, mask_BT, kl_coef)
      advantages_BT, returns_BT = ppo_lib.gae(rewards_BT, values_BT, mask_BT, gamma, lam)
      advantage_mean, _ = ppo_lib.masked_mean_var(advantages_BT, mask_BT)
      stats = {"explained_variance": ppo_lib.explained_variance(values_BT, returns_BT, mask_BT),
               "advantage_mean": advantage_mean,
               # The sampler's log-probs against the trainer's, before any update.
               grpo_lib.LOGPROB_MISMATCH: grpo_lib.logprob_mismatch(old_BT, sampler_BT, mask_BT)}
      if kl_coef:  # Σ log π_old − log π_ref over each completion, mean over completions
        stats["kl"] = jnp.mean(jnp.sum((old_BT - ref_BT) * mask_BT, axis=1))
      rows = {"old_logprobs": old_BT, "old_values": values_BT * mask_BT,
              "advantages": ppo_lib.whiten(advantages_BT, mask_BT), "returns": returns_BT}
      return rows, stats
    token = self.objective.row_shardings(setup.mesh)
    return jax.jit(prepare, in_shardings=(setup.shardings.params, setup.frozen_shardings, token,
                                          batch_sharding(setup.mesh),
                                          batch_sharding(setup.mesh, 1)),
                   out_shardings=({k: batch_sharding(setup.mesh) for k in ROLLOUT_KEYS},
                                  replicated(setup.mesh)))

  def _rollout(self, state, step: int, local: dict, attempt: int):
    """(the batch of rollouts' host rows, its metrics, generation seconds)."""
    prompt_BP, lengths_B = local["prompt_ids"], local["prompt_lengths"]
    records = [self.train_records[int(i)] for i in local["record_index"]]
    rows, rewards_B, by_source, completion_len_B, generation_s = self._sample_and_score(
        state, step, attempt, prompt_BP, lengths_B, records)
    sampler_BT = rows.pop(grpo_lib.SAMPLER_LOGPROBS)
    mesh = self.setup.mesh
    batch = to_global_batch(rows, mesh)
    device = to_global_batch({"sampler": sampler_BT, "r": np.asarray(rewards_B, np.float32)},
                             mesh)
    with jax.set_mesh(mesh):
      extra, stats = self._prepare(state.params, state.frozen, batch, device["sampler"],
                                   device["r"])
    rows.update({k: local_rows(v, mesh) for k, v in extra.items()})
    metrics = {**self.reward_metrics(rewards_B, by_source, completion_len_B),
               **{k: float(v) for k, v in jax.device_get(stats).items()}}
    self._rollout_step = step
    return rows, metrics, generation_s

  def next_batch(self, state, step: int, next_local):
    per_rollout = self.epochs * self.minibatches
    k = (step - 1) % per_rollout
    if k == 0 or self.current is None:
      self.current = self._new_rollouts(state, step, lambda: self._prompts(next_local))
    rows, metrics = self.current
    epoch, j = divmod(k, self.minibatches)
    n = next(iter(rows.values())).shape[0]
    order = np.random.default_rng([self.seed, self._rollout_step, epoch]).permutation(n)
    take = order[j * self.rows_per_step:(j + 1) * self.rows_per_step]
    batch = to_global_batch({name: v[take] for name, v in rows.items()}, self.setup.mesh)
    return batch, {**metrics, "reward_errors": float(self.reward_errors)}

  def _prompts(self, next_local) -> dict:
    """This process's prompts of one batch of rollouts: the stream's next ppo.minibatches
    batches."""
    parts = [next_local() for _ in range(self.minibatches)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def at_boundary(self, step: int) -> bool:
    return step % (self.epochs * self.minibatches) == 0
