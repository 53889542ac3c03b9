"""Sampling from a model with a KV cache: `python -m jaxtrain.generate --checkpoint=... --prompt=...`.

For eyeballing a model (the demo, a fine-tuned checkpoint, an imported Hugging Face model), not
for serving. The prompt is run once through every layer (prefill), writing each layer's keys
and values into a cache of `prompt + max_new_tokens` positions; each new token then costs one
position's worth of compute against the cache (decode). The whole loop is one jitted
`lax.fori_loop`. Greedy decoding at temperature 0; otherwise temperature and nucleus (top-p)
sampling with an explicit seed, so a run is reproducible.

A model's vocabulary is often padded past its tokenizer's (for sharding):
`SamplingConfig.vocab_size` (the tokenizer's, `Tokenizer.vocab_size`) keeps the draws to the ids
the tokenizer can decode.

Batched prompts are right-padded: row b's prompt has `lengths[b]` tokens and its generated
tokens are written from there on, so rows of different lengths decode side by side. Keys past a
row's current position are masked, so padding never leaks into attention.

The cached step is the model's own (`Llama.forward_with_cache`, `Llama.empty_cache`): the same
projections, norms, MLP and RoPE as training, with `attention.cached_attention` over the cache;
a test checks it against the training forward pass token by token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.decoder import Decoder


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  max_new_tokens: int = 64
  temperature: float = 0.0  # 0: greedy
  top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
  eos_id: int | None = None  # rows stop (and are padded with it) after emitting it
  # Ids >= vocab_size are never drawn (their logits are -inf): the tokenizer's real vocabulary
  # when the model's is padded past it. None: every id of the model.
  vocab_size: int | None = None

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
    if self.vocab_size is not None and self.vocab_size < 1:
      raise ValueError(f"vocab_size={self.vocab_size}: must be >= 1 (or None: every id)")


def sample_token(logits_BV, key, temperature: float, top_p: float,
                 vocab_size: int | None = None) -> jax.Array:
  """[B] int32: argmax at temperature 0, else a draw from the tempered, top-p-truncated
  softmax (the smallest set of most likely tokens whose probability reaches top_p). Ids >=
  `vocab_size` (when given) are never chosen."""
  logits_BV = mask_vocab(logits_BV, vocab_size)
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # A token stays if the mass strictly before it is below top_p (so the top one always does).
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept = jnp.sum(before_BV < top_p, axis=-1)
    cutoff_B = jnp.take_along_axis(sorted_BV, (kept - 1)[:, None], axis=-1)
    logits_BV = jnp.where(logits_BV >= cutoff_B, logits_BV, -jnp.inf)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def sampled_logprobs(logits_BV, tokens_B, temperature: float, vocab_size: int | None = None):
  """[B] float32 log-probs of `tokens_B` under softmax(logits / temperature) over the ids
  `vocab_size` allows: the tempered distribution `sample_token` draws from, before its top-p
  cut (what the RL trainer recomputes: jaxtrain.objectives.grpo.loss.token_logprobs at
  grpo.temperature). Temperature 0 (greedy) gives temperature 1's: the argmax is a point mass, with
  no log-probs worth recording, and nothing is divided by 0.

  Why not the top-p-renormalized one: the trainer would have to rebuild every position's nucleus
  in its chunked head (a sort over the vocabulary per position), and the nucleus moves with the
  weights, so a sampled token can leave the updated policy's or the reference's nucleus and get
  a log-prob of -inf (an infinite KL, a ratio of 0). The tempered full softmax is what TRL and
  verl train on too; with top_p < 1 the draw's own log-prob is higher by -log(kept mass), at
  most -log(top_p), and the ratio does not correct for the truncation (docs/finetuning.md)."""
  t = temperature if temperature > 0 else 1.0
  all_BV = jax.nn.log_softmax(mask_vocab(logits_BV.astype(jnp.float32), vocab_size) / t,
                              axis=-1)
  return jnp.take_along_axis(all_BV, tokens_B[:, None], axis=-1)[:, 0]


def mask_vocab(logits_BV, vocab_size: int | None):
  """The logits with ids >= `vocab_size` at -inf (unchanged when None or >= the model's)."""
  v = logits_BV.shape[-1]
  if vocab_size is None or vocab_size >= v:
    return logits_BV
  return jnp.where(jnp.arange(v) < vocab_size, logits_BV, -jnp.inf)


@functools.partial(nnx.jit, static_argnames=("sampling",))
def generate_tokens(model: Decoder, prompt_BP, lengths_B, key, sampling: SamplingConfig):
  """[B, max_new_tokens] int32 continuations of right-padded prompts (row b: first lengths_B[b]
  tokens). After a row emits `sampling.eos_id` it emits only that id."""
  return sample_continuations(model, prompt_BP, lengths_B, key, sampling)


def sample_continuations(model: Decoder, prompt_BP, lengths_B, key, sampling: SamplingConfig,
                         *, with_logprobs: bool = False, with_routing: bool = False):
  """`generate_tokens` without its jit, for callers that trace it inside their own (the GRPO
  rollouts, which merge the model from the live sharded params).

  `with_logprobs`: returns (tokens [B, N], log-probs [B, N] float32), each generated token's
  log-probability under the distribution it was drawn from: log_softmax of its logits divided
  by `sampling.temperature` (1 when greedy) over the ids `sampling.vocab_size` allows (the
  tokenizer's; all the model's when None), before the top-p cut (`sampled_logprobs` says why).
  That is what the RL trainer computes for the same token from the same weights
  (grpo.token_logprobs with the same vocab_limit and temperature), so the two can be compared
  (`logprob_mismatch`). 0 after a row's EOS.

  `with_routing` (an MoE model): also the experts every layer chose for every position's token
  as it went through the model, [num_layers, B, P + N, k] int32: position t < lengths_B[b] the
  prompt's token t (prefill), position lengths_B[b] + i the i-th generated token (fed back to
  produce the next; the last one never is). A training row of the prompt and its completion
  has its tokens at the same positions, so the row's routing is these positions'
  (`Decoder.hidden_states(routing_LBTK=)` replays it). Outputs come in the order tokens,
  log-probs, routing, each only when asked for."""
  b, p = prompt_BP.shape
  n = sampling.max_new_tokens
  cache = model.empty_cache(b, p + n)
  routing_LBSK = None  # carried through the loop only when asked for
  if with_routing:
    logits_BPV, cache, routing_LBPK = model.forward_with_cache(
        prompt_BP, jnp.zeros((b,), jnp.int32), cache, with_routing=True)
    routing_LBSK = jnp.pad(routing_LBPK, ((0, 0), (0, 0), (0, n), (0, 0)))
  else:
    logits_BPV, cache = model.forward_with_cache(prompt_BP, jnp.zeros((b,), jnp.int32), cache)
  rows_B = jnp.arange(b)
  last_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  out_BN = jnp.zeros((b, n), jnp.int32)
  logprobs_BN = jnp.zeros((b, n), jnp.float32)
  done_B = jnp.zeros((b,), bool)
  eos = -1 if sampling.eos_id is None else sampling.eos_id
  # NNX transforms (the layer scan) refuse variables traced at an outer level: the model's
  # state rides in the loop carry, and the body rebuilds the model from it.
  graphdef, state = nnx.split(model)

  def body(i, carry):
    state, cache, last_BV, out_BN, logprobs_BN, routing_LBSK, done_B, key = carry
    key, draw = jax.random.split(key)
    token_B = sample_token(last_BV, draw, sampling.temperature, sampling.top_p,
                           sampling.vocab_size)
    token_B = jnp.where(done_B, eos, token_B)
    out_BN = out_BN.at[:, i].set(token_B)
    if with_logprobs:
      logprob_B = sampled_logprobs(last_BV, token_B, sampling.temperature, sampling.vocab_size)
      logprobs_BN = logprobs_BN.at[:, i].set(jnp.where(done_B, 0.0, logprob_B))
    done_B = done_B | (token_B == eos)
    model = nnx.merge(graphdef, state)
    if with_routing:  # each row's token goes in at its own position
      logits_B1V, cache, routing_LB1K = model.forward_with_cache(
          token_B[:, None], lengths_B + i, cache, with_routing=True)
      routing_LBSK = routing_LBSK.at[:, rows_B, lengths_B + i].set(routing_LB1K[:, :, 0])
    else:
      logits_B1V, cache = model.forward_with_cache(token_B[:, None], lengths_B + i, cache)
    return state, cache, logits_B1V[:, 0], out_BN, logprobs_BN, routing_LBSK, done_B, key

  carry = (state, cache, last_BV, out_BN, logprobs_BN, routing_LBSK, done_B, key)
  carry = jax.lax.fori_loop(0, n, body, carry)
  outputs = ((carry[3],) + ((carry[4],) if with_logprobs else ())
             + ((carry[5],) if with_routing else ()))
  return outputs if len(outputs) > 1 else outputs[0]


def generate(model: Decoder, prompts: list[np.ndarray], sampling: SamplingConfig,
             seed: int = 0) -> list[np.ndarray]:
  """Continuations of token-id prompts (each cut at its first EOS, which is kept)."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate needs at least one prompt, each with at least one token (e.g. BOS)")
  width = max(len(p) for p in prompts)
  prompt_BP = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    prompt_BP[i, :len(p)] = p
  lengths_B = np.array([len(p) for p in prompts], np.int32)
  out_BN = np.asarray(generate_tokens(model, jnp.asarray(prompt_BP), jnp.asarray(lengths_B),
                                      jax.random.key(seed), sampling))
  results = []
  for row in out_BN:
    if sampling.eos_id is not None and (row == sampling.eos_id).any():
      row = row[:int(np.argmax(row == sampling.eos_id)) + 1]
    results.append(row)
  return results

