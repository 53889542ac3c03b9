"""GRPO's batches: completions sampled with the live weights, scored, turned into training rows.

Each batch of rollouts: the step's prompts (train.global_batch_size of them) are repeated
grpo.num_generations times, completed by one jitted prefill-and-decode (`generate`'s, over the
run's mesh, reading the sharded params in place), decoded to text and scored by the reward
functions; the group-relative advantages and the [B, T] rows of prompt + completion (loss on
the completion tokens), with the sampler's log-prob of every completion token, are the train
step's batch for grpo.num_iterations steps. Draws are limited to the tokenizer's vocabulary
(the model's may be padded past it).

Sampling keys are fold_in(key(train.seed), step), so a resumed run draws the same completions as
an uninterrupted one. Rows of one prompt stay on the process that read it (the repeat happens
on the host), so each process scores its own rows; the logged reward and length statistics
are the whole global batch's (gathered from every process). Everything a reward function returns
is checked (jaxtrain.objectives.grpo.rewards.score); grpo.on_reward_error says whether a failure
stops the run or skips that batch of rollouts, on every process alike (a failure on one is a failure
on all).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain.data import prompts as prompts_lib
from jaxtrain.data.documents import tokenizer_for
from jaxtrain.data.sources.common import DataError
from jaxtrain.generate import sampler as generate_lib
from jaxtrain.objectives.feeders import Feeder, local_rows, to_global_batch
from jaxtrain.objectives.forward import merge_model
from jaxtrain.objectives.grpo import loss as grpo_lib
from jaxtrain.objectives.grpo import reward_models, rewards
from jaxtrain.parallel.mesh import batch_sharding, replicated

COMPLETIONS_FILE = "completions.jsonl"


def completion_lengths(tokens_BN: np.ndarray, eos_id: int | None) -> np.ndarray:
  """[B] tokens of each completion: up to and including its first EOS, else all N."""
  n = tokens_BN.shape[1]
  if eos_id is None:
    return np.full(tokens_BN.shape[0], n, np.int32)
  is_eos_BN = tokens_BN == eos_id
  return np.where(is_eos_BN.any(axis=1), is_eos_BN.argmax(axis=1) + 1, n).astype(np.int32)


def training_rows(prompt_BP: np.ndarray, prompt_len_B: np.ndarray, tokens_BN: np.ndarray,
                  completion_len_B: np.ndarray, seq_len: int,
                  sampler_logprobs_BN: np.ndarray | None = None,
                  routing_BSLK: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """The language-model rows of prompt + completion, [B, seq_len] each: position t predicts
  token t+1, and the loss mask marks the targets that are completion tokens.

  With `sampler_logprobs_BN` (generate.sample_continuations' with_logprobs), also
  grpo_lib.SAMPLER_LOGPROBS: the sampler's log-prob of each completion token at the position
  that predicts it, like the trainer's per-token log-probs; NaN elsewhere (`no_sampler_logprobs`
  for rows whose completions were not sampled).

  With `routing_BSLK` (generate.sample_continuations' with_routing, batch first: [B, P + N,
  layers, k]), also grpo_lib.ROUTING [B, seq_len, layers, k]: the experts the rollout chose for
  each input token (row position t is the token the rollout fed at position t), -1 past the
  row's end."""
  b = prompt_BP.shape[0]
  rows = {"inputs": np.zeros((b, seq_len), np.int32), "targets": np.zeros((b, seq_len), np.int32),
          "loss_mask": np.zeros((b, seq_len), np.float32),
          "segment_ids": np.zeros((b, seq_len), np.int32),
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (b, seq_len)).copy()}
  if sampler_logprobs_BN is not None:
    rows.update(no_sampler_logprobs(b, seq_len))
  if routing_BSLK is not None:
    rows.update(no_routing(b, seq_len, *routing_BSLK.shape[2:]))
  for i in range(b):
    p, c = int(prompt_len_B[i]), int(completion_len_B[i])
    z = np.concatenate([prompt_BP[i, :p], tokens_BN[i, :c]])
    m = len(z) - 1  # positions with a target
    rows["inputs"][i, :m] = z[:-1]
    rows["targets"][i, :m] = z[1:]
    rows["segment_ids"][i, :m] = 1
    rows["loss_mask"][i, p - 1:m] = 1.0  # targets p .. p+c-1: the completion
    if sampler_logprobs_BN is not None:
      rows[grpo_lib.SAMPLER_LOGPROBS][i, p - 1:m] = sampler_logprobs_BN[i, :c]
    if routing_BSLK is not None:
      rows[grpo_lib.ROUTING][i, :m] = routing_BSLK[i, :m]
  return rows


def no_routing(b: int, seq_len: int, layers: int, k: int) -> dict[str, np.ndarray]:
  """{grpo_lib.ROUTING: -1 [b, seq_len, layers, k]}: nothing recorded, every token chooses its
  own experts (a warm-up's rows)."""
  return {grpo_lib.ROUTING: np.full((b, seq_len, layers, k), -1, np.int32)}


def no_sampler_logprobs(b: int, seq_len: int) -> dict[str, np.ndarray]:
  """{grpo_lib.SAMPLER_LOGPROBS: NaN [b, seq_len]}: rows without a sampled token (a supervised
  warm-up's), which logprob_mismatch leaves out."""
  return {grpo_lib.SAMPLER_LOGPROBS: np.full((b, seq_len), np.nan, np.float32)}


def gather_rows(arrays: dict[str, np.ndarray], mesh) -> dict[str, np.ndarray]:
  """{name: [B_global]} on every process from each process's {name: [B_local]} (its rows of a
  global batch, as it fed them), in the global batch's row order, values exact (they travel as
  their bits, so float64 rewards stay float64). One process: the arrays as they are."""
  if jax.process_count() == 1:
    return dict(arrays)
  bits = {k: np.ascontiguousarray(v).view(np.uint32).reshape(len(v), -1)
          for k, v in arrays.items()}
  gathered = multihost_utils.process_allgather(to_global_batch(bits, mesh), tiled=True)
  return {k: np.ascontiguousarray(gathered[k]).view(v.dtype).reshape(-1)
          for k, v in arrays.items()}


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process (every process must call it)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))


class Rollouts(Feeder):
  """The GRPO feeder: one batch of rollouts every grpo.num_iterations steps."""

  def __init__(self, config, setup, objective, workdir: str):
    super().__init__(setup)
    g = config.grpo
    self.objective, self.workdir = objective, workdir
    self.group, self.iterations = objective.num_generations, objective.num_iterations
    self.seq_len, self.seed = int(config.train.seq_len), int(config.train.seed)
    self.loss_chunk_size = int(config.train.loss_chunk_size)
    self.tokenizer = tokenizer_for(config.data.tokenizer)
    # Only ids the tokenizer can decode are drawn (the model's vocabulary may be padded past it);
    # at the objective's temperature, the one its log-probs are taken at (policy_logprobs).
    self.sampling = generate_lib.SamplingConfig(
        max_new_tokens=int(g.max_new_tokens), temperature=objective.temperature,
        top_p=float(g.top_p), eos_id=self.tokenizer.eos_id,
        vocab_size=int(self.tokenizer.vocab_size))
    self.greedy = dataclasses.replace(self.sampling, temperature=0.0, top_p=1.0)
    self.reward_fns = [(name, rewards.resolve(name)) for name in objective.reward_fn_names()]
    # Frozen reward models beside the functions (grpo.reward_models), on the run's mesh.
    self.reward_models = [
        reward_models.RewardModelScorer(spec, setup.mesh, row_length=self.seq_len,
                                        hf_dtype=str(config.model.param_dtype))
        for spec in objective.reward_model_specs()]
    self.source_names = objective.reward_source_names()
    self.routing_dims = (int(config.model.num_layers), int(config.moe.experts_per_token))
    self.on_error, self.max_skipped = g.on_reward_error, int(g.max_skipped_batches)
    self.sample_prompts = int(g.sample_prompts)
    self.warmup_steps, self.warmup_column = int(g.warmup_steps), str(g.warmup_column)
    self.train_records, self.eval_records = prompts_lib.load_splits(config)
    self.is_chief = jax.process_index() == 0
    self._generate = {}
    self._old_logprobs = self._jit_old_logprobs() if self.iterations > 1 else None
    self.current = None  # (device batch, host metrics) of the latest rollouts
    self.reward_errors = 0  # batches of rollouts skipped for a reward function's failure
    self._last_rollout_end = None

  # -- jitted pieces ------------------------------------------------------------------------------

  def _jit_generate(self, sampling, with_logprobs: bool, with_routing: bool = False):
    signature = (sampling, with_logprobs, with_routing)
    if signature not in self._generate:
      setup, mesh = self.setup, self.setup.mesh
      graphdef = setup.graphdef

      def sample(params, frozen, prompt_BP, lengths_B, key):
        model = merge_model(graphdef, params, frozen)
        out = generate_lib.sample_continuations(model, prompt_BP, lengths_B, key, sampling,
                                                with_logprobs=with_logprobs,
                                                with_routing=with_routing)
        if with_routing:  # [L, B, S, k] -> [B, S, L, k]: batch first, like every row array
          out = (*out[:-1], jnp.transpose(out[-1], (1, 2, 0, 3)))
        return out
      rows = batch_sharding(mesh)
      outs = (rows,) + ((rows,) if with_logprobs else ()) + (
          (batch_sharding(mesh, 4),) if with_routing else ())
      self._generate[signature] = jax.jit(
          sample, in_shardings=(setup.shardings.params, setup.frozen_shardings,
                                batch_sharding(mesh), batch_sharding(mesh, 1), replicated(mesh)),
          out_shardings=outs if len(outs) > 1 else outs[0])
    return self._generate[signature]

  def _jit_old_logprobs(self):
    setup, chunk = self.setup, self.loss_chunk_size
    graphdef = setup.graphdef

    def old_logprobs(params, frozen, batch):
      # Layout order: GRPO runs without a context axis (its config check), so it is the rows'.
      model = merge_model(graphdef, params, frozen)
      # The distribution the rollouts drew from (grpo.temperature), as the loss's.
      return self.objective.policy_logprobs(model, batch, chunk_size=chunk)
    return jax.jit(old_logprobs, in_shardings=(setup.shardings.params, setup.frozen_shardings,
                                               self.objective.row_shardings(setup.mesh)),
                   out_shardings=batch_sharding(setup.mesh))

  # -- one batch of rollouts ----------------------------------------------------------------------

  def _complete(self, state, prompt_BP, lengths_B, key, sampling, with_logprobs=False,
                with_routing=False):
    """(completion tokens [B, N], their lengths [B]) of this process's rows; with
    `with_logprobs`, a third item: the sampler's log-probs of the tokens [B, N]; and then with
    `with_logprobs` a fourth: the experts chosen at every position [B, P + N, layers, k] when
    `with_routing`, else None."""
    mesh = self.setup.mesh
    inputs = to_global_batch({"prompt": prompt_BP, "lengths": lengths_B}, mesh)
    with jax.set_mesh(mesh):
      out = self._jit_generate(sampling, with_logprobs, with_routing)(
          state.params, state.frozen, inputs["prompt"], inputs["lengths"], key)
    out = out if isinstance(out, tuple) else (out,)
    tokens_BN = local_rows(out[0], mesh)
    lengths = completion_lengths(tokens_BN, sampling.eos_id)
    if not with_logprobs:
      return tokens_BN, lengths
    routing = local_rows(out[2], mesh) if with_routing else None
    return tokens_BN, lengths, local_rows(out[1], mesh), routing

  def _score(self, records, prompt_BP, lengths_B, tokens_BN, completion_len_B):
    """(rewards [B], {source name: its rewards [B]}, prompt texts, completion texts) of this
    process's rows: the functions' sum plus each reward model's weighted score. Raises
    rewards.RewardError on every process when a reward function failed on any (so they all
    skip, or all stop, together)."""
    decode = self.tokenizer.decode
    b = len(records)
    prompts = [decode(prompt_BP[i, :lengths_B[i]]) for i in range(b)]
    completions = [decode(tokens_BN[i, :completion_len_B[i]]) for i in range(b)]
    # The reward models first: their forward pass is a collective every process must join,
    # whether or not a function fails here.
    eos = self.tokenizer.eos_id
    ended_B = np.array([eos is not None and c > 0 and tokens_BN[i, c - 1] == eos
                        for i, c in enumerate(completion_len_B)], bool)
    by_model = [scorer(records, completions, ended_B) for scorer in self.reward_models]
    names = sorted({k for r in records for k in r if k != "prompt"})
    columns = {k: [r.get(k) for r in records] for k in names}
    error, by_fn = None, []
    try:
      by_fn = rewards.score_each(self.reward_fns, prompts, completions, columns)
    except rewards.RewardError as e:
      error = e
    if any_process(error is not None):
      raise error or rewards.RewardError(
          "a reward function failed on another process of this run (its output has the message)")
    total = np.zeros(b, np.float64)
    for values in by_fn:
      total += values
    for scorer, values in zip(self.reward_models, by_model):
      total += scorer.spec.weight * values
    return total, dict(zip(self.source_names, by_fn + by_model)), prompts, completions

  def _gather_scores(self, rewards_B, by_source, completion_len_B) -> dict[str, np.ndarray]:
    """{"rewards", "lengths", "source_<name>"...: [B_global]}: the whole global batch's
    (every process's rows), for statistics."""
    return gather_rows({"rewards": rewards_B, "lengths": completion_len_B,
                        **{f"source_{k}": v for k, v in by_source.items()}}, self.setup.mesh)

  def reward_metrics(self, rewards_B, by_source, completion_len_B) -> dict[str, float]:
    """The logged statistics of a batch of rollouts over the whole global batch: the reward's
    mean and spread, each source's mean (reward_<name>_mean), the mean length."""
    return _statistics(self._gather_scores(rewards_B, by_source, completion_len_B))

  def _reference_completions(self, records, indices_B):
    """(tokens [B, N], lengths [B]) of the records' warm-up column, EOS-terminated and cut to
    grpo.max_new_tokens."""
    n, eos = self.sampling.max_new_tokens, self.tokenizer.eos_id
    tokens_BN = np.zeros((len(records), n), np.int32)
    lengths_B = np.zeros(len(records), np.int32)
    for i, (record, index) in enumerate(zip(records, indices_B)):
      if self.warmup_column not in record:
        raise DataError(f"record {int(index)}: no {self.warmup_column!r} field for the "
                        f"supervised warm-up (grpo.warmup_column, grpo.warmup_steps="
                        f"{self.warmup_steps})")
      ids = self.tokenizer.encode(str(record[self.warmup_column]))
      ids = np.concatenate([ids, [] if eos is None else [eos]]).astype(np.int32)[:n]
      tokens_BN[i, :len(ids)], lengths_B[i] = ids, len(ids)
    return tokens_BN, lengths_B

  def _warmup_batch(self, local: dict):
    """The supervised warm-up: each prompt's reference completion in all G rows, advantage 1
    (ratio 1: the GRPO loss's gradient is then the supervised one's)."""
    g = self.group
    prompt_BP = np.repeat(local["prompt_ids"], g, axis=0)
    lengths_B = np.repeat(local["prompt_lengths"], g, axis=0)
    indices_B = np.repeat(local["record_index"], g)
    records = [self.train_records[int(i)] for i in indices_B]
    tokens_BN, completion_len_B = self._reference_completions(records, indices_B)
    rows = training_rows(prompt_BP, lengths_B, tokens_BN, completion_len_B, self.seq_len)
    rows.update(no_sampler_logprobs(len(records), self.seq_len))
    if self.objective.replay_routing:  # not sampled: every token routes itself
      rows.update(no_routing(len(records), self.seq_len, *self.routing_dims))
    rows["advantages"] = np.ones(len(records), np.float32)
    return rows

  def _sample_and_score(self, state, step: int, attempt: int, prompt_BP, lengths_B, records):
    """One completion per prompt row, sampled with the live weights (the key from the step and
    the attempt) and scored: (training rows with the sampler's log-probs and routing, rewards
    [B], rewards by source, completion lengths [B], generation seconds)."""
    key = jax.random.fold_in(jax.random.key(self.seed), step)
    if attempt:
      key = jax.random.fold_in(key, attempt)
    jax.block_until_ready(state.params)  # the last step's update: not generation time
    start = time.perf_counter()
    tokens_BN, completion_len_B, logprobs_BN, routing = self._complete(
        state, prompt_BP, lengths_B, key, self.sampling, with_logprobs=True,
        with_routing=self.objective.replay_routing)
    generation_s = time.perf_counter() - start
    rewards_B, by_source, _, _ = self._score(records, prompt_BP, lengths_B, tokens_BN,
                                             completion_len_B)
    rows = training_rows(prompt_BP, lengths_B, tokens_BN, completion_len_B, self.seq_len,
                         logprobs_BN, routing)
    return rows, rewards_B, by_source, completion_len_B, generation_s

  def _rollout(self, state, step: int, local: dict, attempt: int):
    g = self.group
    if step <= self.warmup_steps:
      return self._device_batch(state, self._warmup_batch(local)), {}, 0.0
    prompt_BP = np.repeat(local["prompt_ids"], g, axis=0)
    lengths_B = np.repeat(local["prompt_lengths"], g, axis=0)
    records = [self.train_records[int(i)] for i in np.repeat(local["record_index"], g)]
    rows, rewards_B, by_source, completion_len_B, generation_s = self._sample_and_score(
        state, step, attempt, prompt_BP, lengths_B, records)
    rows["advantages"] = np.asarray(grpo_lib.group_advantages(rewards_B, g), np.float32)
    batch = self._device_batch(state, rows)
    return batch, self.reward_metrics(rewards_B, by_source, completion_len_B), generation_s

  def _device_batch(self, state, rows):
    """The train step's batch of host rows; with num_iterations > 1 the sampling policy's
    log-probs (the current weights') added."""
    batch = to_global_batch(rows, self.setup.mesh)
    if self._old_logprobs is not None:
      with jax.set_mesh(self.setup.mesh):
        batch[grpo_lib.OLD_LOGPROBS] = self._old_logprobs(
            state.params, state.frozen, {k: batch[k] for k in self.objective.row_keys})
    return batch

  def next_batch(self, state, step: int, next_local):
    if (step - 1) % self.iterations == 0 or self.current is None:
      self.current = self._new_rollouts(state, step, next_local)
    batch, metrics = self.current
    return batch, {**metrics, "reward_errors": float(self.reward_errors)}

  def _new_rollouts(self, state, step: int, next_local):
    previous_end = self._last_rollout_end
    attempt = 0
    while True:
      local = next_local()
      try:
        batch, metrics, generation_s = self._rollout(state, step, local, attempt)
        break
      except rewards.RewardError as e:
        if self.on_error != "skip":
          raise
        self.reward_errors += 1
        attempt += 1
        if self.is_chief:
          print(f"warning: step {step}: {e}; batch of rollouts skipped "
                f"(grpo.on_reward_error='skip')", flush=True)
        if attempt >= self.max_skipped:
          raise rewards.RewardError(f"{e} ({attempt} batches of rollouts in a row; "
                                    f"grpo.max_skipped_batches={self.max_skipped})") from None
    end = time.perf_counter()
    # The share of wall time spent generating, between this batch of rollouts and the last.
    interval = end - previous_end if previous_end is not None else None
    self._last_rollout_end = end
    if metrics:  # sampled rollouts (the warm-up's have no rewards to report)
      metrics["generation_share"] = (min(1.0, generation_s / interval) if interval else None)
    return batch, metrics

  def at_boundary(self, step: int) -> bool:
    return step % self.iterations == 0

  # -- evaluation ---------------------------------------------------------------------------------

  def evaluate(self, state, step: int, eval_batches):
    """Greedy completions of the eval prompts: their mean reward and length (no loss: GRPO has
    no held-out loss to report). The first grpo.sample_prompts go to completions.jsonl."""
    parts, samples = [], []
    for local in eval_batches:
      records = [self.eval_records[int(i)] for i in local["record_index"]]
      tokens_BN, completion_len_B = self._complete(
          state, local["prompt_ids"], local["prompt_lengths"], jax.random.key(self.seed),
          self.greedy)
      try:
        rewards_B, by_source, prompts, completions = self._score(
            records, local["prompt_ids"], local["prompt_lengths"], tokens_BN, completion_len_B)
      except rewards.RewardError as e:
        if self.on_error != "skip":
          raise
        if self.is_chief:
          print(f"warning: eval at step {step}: {e}; eval batch skipped", flush=True)
        continue
      # The whole eval batch's (every process's rows); the samples are process 0's rows.
      parts.append(self._gather_scores(rewards_B, by_source, completion_len_B))
      for p, c, r in zip(prompts, completions, rewards_B):
        if len(samples) < self.sample_prompts:
          samples.append({"step": step, "prompt": p, "completion": c, "reward": float(r)})
    if self.is_chief and samples:
      with open(os.path.join(self.workdir, COMPLETIONS_FILE), "a", encoding="utf-8") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    if not parts:
      return {"eval_loss": None, "eval_reward_mean": None, "eval_completion_len_mean": None}
    stats = _statistics({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    del stats["reward_std"]
    return {"eval_loss": None, **{f"eval_{k}": v for k, v in stats.items()}}


def _statistics(scores: dict[str, np.ndarray]) -> dict[str, float]:
  """reward_mean, reward_std, reward_<source>_mean and completion_len_mean of gathered scores."""
  out = {"reward_mean": float(scores["rewards"].mean()),
         "reward_std": float(scores["rewards"].std())}
  out.update({f"reward_{k.removeprefix('source_')}_mean": float(v.mean())
              for k, v in scores.items() if k.startswith("source_")})
  out["completion_len_mean"] = float(scores["lengths"].mean())
  return out
