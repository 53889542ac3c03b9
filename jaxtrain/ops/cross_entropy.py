"""Fused cross-entropy over a large vocabulary: loss and gradient without [B, T, V] logits.

The head projection and the softmax run over chunks of C positions, so float32 logits exist
only as [B, C, V] blocks. Under differentiation the forward pass also computes the gradient of
each chunk right away (d logits = softmax - one_hot, times the loss mask) and contracts it into
dx and dW, which are saved for the backward pass; the backward pass then only scales them by
the incoming cotangent. Compared with rematerializing each chunk in the backward pass, this
skips one [B*C, D] x [D, V] matmul per chunk (three head matmuls per step instead of four),
which matters where the head is a large share of the model (small models, 128k vocabularies).
Without differentiation (eval) only the loss is computed.

Shapes: x_BTD hidden states, w_DV head weights, targets_BT int32, mask_BT loss weights. A tied
head is passed as the embedding table itself, [V, D] with `vocab_axis=0`, and contracted as it
is stored: its transposed copy, made once before the chunk loop, would hold V x D more bytes for
the whole step (2.6 GiB for Gemma 3 27B's 262K-word table in bfloat16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.ops import fp8
from jaxtrain.ops.projection import transposed_input_matmul
from jaxtrain.parallel.context_parallel import context_size
from jaxtrain.parallel.mesh import shard


def _chunked(x_BTD, targets_BT, mask_BT, chunk_size: int):
  """[N, B, C, ...] each: chunks of C positions, scanned over N.

  Under a `context` axis of size S the sequence is split over S devices, so each chunk takes
  C/S positions from every device's part (the chunk dim stays split over `context` and the scan
  never moves activations between devices); the loss is a sum, so the order is free. Each part
  is padded to a multiple of C/S (padding has mask 0). With S = 1: consecutive chunks of C.
  """
  b, t, d = x_BTD.shape
  s = context_size()
  s = s if t % s == 0 else 1
  local = t // s
  c = min(max(chunk_size // s, 1), local)
  pad = (-local) % c
  n = (local + pad) // c

  def split(x_BT):  # [B, T, ...] -> [N, B, S*c, ...]
    x = x_BT.reshape(b, s, local, *x_BT.shape[2:])
    if pad:
      x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    x = x.reshape(b, s, n, c, *x_BT.shape[2:])
    x = jnp.moveaxis(x, 2, 0)
    return x.reshape(n, b, s * c, *x_BT.shape[2:])

  x_NBCD = split(x_BTD)
  if s > 1:
    x_NBCD = shard(x_NBCD, (None, "act_batch", "act_length", "act_embed"))
  return x_NBCD, split(targets_BT), split(mask_BT.astype(jnp.float32))


def _unchunked(x_NBCD, t: int):
  """The inverse of `_chunked` for one [N, B, C, D] array: [B, T, D]."""
  n, b, sc, d = x_NBCD.shape
  s = context_size()
  s = s if t % s == 0 else 1
  c = sc // s
  x = x_NBCD.reshape(n, b, s, c, d)
  x = jnp.moveaxis(x, 0, 2).reshape(b, s, n * c, d)[:, :, :t // s]
  return x.reshape(b, t, d)


def _flat(x_BCX):
  return x_BCX.reshape(-1, x_BCX.shape[-1])


def _contract(a_NX, w, axis: int):
  """a [N, X] times w over w's dim `axis` (the one of size X), float32: [N, w's other dim]."""
  if axis == 0:
    return jnp.dot(a_NX, w, preferred_element_type=jnp.float32)
  return jax.lax.dot_general(a_NX, w, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _head(x_BCD, w, vocab_axis: int = 1, w_scale=None):
  """float32 logits [B, C, V]. Matmuls here run on tokens flattened to one dim: the weight
  gradient then contracts one dim, not two, which XLA:CPU runs as a single GEMM. `w_scale`: `w`
  is the head's e4m3 copy with this scale (precision.fp8_head); the chunk is scaled to e4m3
  too."""
  b, c, _ = x_BCD.shape
  x_ND = _flat(x_BCD)
  if w_scale is None:
    logits_NV = _contract(x_ND, w, 1 - vocab_axis)
  else:
    xq_ND, x_scale = fp8.quantize(x_ND, fp8.E4M3)
    logits_NV = _contract(xq_ND, w, 1 - vocab_axis) * (x_scale * w_scale)
  logits_BCV = logits_NV.reshape(b, c, -1)
  return shard(logits_BCV, ("act_batch", "act_length", "act_vocab"))


def _chunk_loss(x_BCD, w, targets_BC, mask_BC, vocab_axis: int = 1, w_scale=None):
  """(summed masked loss of the chunk, its float32 logits, their log-sum-exp)."""
  logits_BCV = _head(x_BCD, w, vocab_axis, w_scale)
  lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
  # A one-hot contraction rather than a gather: it stays local when V is sharded.
  onehot_BCV = jax.nn.one_hot(targets_BC, w.shape[vocab_axis], dtype=jnp.float32)
  target_logit_BC = jnp.sum(logits_BCV * onehot_BCV, axis=-1)
  return jnp.sum((lse_BC - target_logit_BC) * mask_BC), logits_BCV, lse_BC, onehot_BCV


def _loss_sum(x_BTD, w, targets_BT, mask_BT, chunk_size: int, vocab_axis: int,
              in_fp8: bool = False):
  x_NBCD, targets_NBC, mask_NBC = _chunked(x_BTD, targets_BT, mask_BT, chunk_size)
  w, w_scale = fp8.quantize(w, fp8.E4M3) if in_fp8 else (w, None)

  def body(total, xs):
    return total + _chunk_loss(xs[0], w, xs[1], xs[2], vocab_axis, w_scale)[0], None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (x_NBCD, targets_NBC, mask_NBC))
  return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def cross_entropy_sum(x_BTD, w, targets_BT, mask_BT, chunk_size: int,
                      explicit_transpose_for_dw: bool = False, vocab_axis: int = 1,
                      in_fp8: bool = False):
  """Sum over positions of mask * (next-token cross-entropy), float32. `w`: the head [D, V]
  (`vocab_axis=1`) or a tied embedding table [V, D] (`vocab_axis=0`).

  `explicit_transpose_for_dw` (CPU): the head's weight gradient contracts a materialized x^T
  (peft.projection.transposed_input_matmul), which XLA:CPU runs faster. `in_fp8`
  (precision.fp8_head): the head's three matmuls in FP8 as jaxtrain/ops/fp8.py does them (the head
  scaled once, each chunk of hidden states and of logit gradients on its own).
  """
  del explicit_transpose_for_dw  # only the gradient depends on it
  return _loss_sum(x_BTD, w, targets_BT, mask_BT, chunk_size, vocab_axis, in_fp8)


def _weight_grad(x_ND, dlogits_NV, vocab_axis: int, explicit_transpose_for_dw: bool):
  """The chunk's head gradient in the head's layout: x^T dlogits [D, V], or its transpose."""
  if vocab_axis == 0:
    return jnp.dot(dlogits_NV.T, x_ND, preferred_element_type=jnp.float32)
  if explicit_transpose_for_dw:
    return transposed_input_matmul(x_ND, dlogits_NV, preferred_element_type=jnp.float32)
  return jnp.dot(x_ND.T, dlogits_NV, preferred_element_type=jnp.float32)


def _fwd(x_BTD, w, targets_BT, mask_BT, chunk_size, explicit_transpose_for_dw, vocab_axis,
         in_fp8=False):
  b, t, d = x_BTD.shape
  x_NBCD, targets_NBC, mask_NBC = _chunked(x_BTD, targets_BT, mask_BT, chunk_size)
  # The accumulator keeps the head's own sharding (vocab over tensor, embed over fsdp), so no
  # device ever holds a whole float32 head.
  w_names = ("embed", "vocab") if vocab_axis == 1 else ("vocab", "embed")
  wq, w_scale = fp8.quantize(w, fp8.E4M3) if in_fp8 else (w, None)

  def body(carry, xs):
    total, dw = carry
    x_BCD, targets_BC, mask_BC = xs
    loss, logits_BCV, lse_BC, onehot_BCV = _chunk_loss(x_BCD, wq, targets_BC, mask_BC,
                                                       vocab_axis, w_scale)
    dlogits_BCV = (jnp.exp(logits_BCV - lse_BC[..., None]) - onehot_BCV) * mask_BC[..., None]
    x_ND, dlogits_NV = _flat(x_BCD), _flat(dlogits_BCV)
    if in_fp8:  # e5m2 logit gradients against the e4m3 head and hidden states, then unscaled
      gq_NV, g_scale = fp8.quantize(dlogits_NV, fp8.E5M2)
      xq_ND, x_scale = fp8.quantize(x_ND, fp8.E4M3)
      dx_ND = _contract(gq_NV, wq, vocab_axis) * (g_scale * w_scale)
      dw_chunk = _weight_grad(xq_ND, gq_NV, vocab_axis, False) * (x_scale * g_scale)
    else:
      if vocab_axis == 1:
        dx_ND = jnp.dot(dlogits_NV.astype(w.dtype), w.T, preferred_element_type=jnp.float32)
      else:
        dx_ND = _contract(dlogits_NV.astype(w.dtype), w, 0)
      dw_chunk = _weight_grad(x_ND, dlogits_NV.astype(x_BCD.dtype), vocab_axis,
                              explicit_transpose_for_dw)
    dx_BCD = dx_ND.reshape(x_BCD.shape)
    dw = shard(dw + dw_chunk, w_names)
    return (total + loss, dw), dx_BCD.astype(x_BCD.dtype)

  init = (jnp.zeros((), jnp.float32), shard(jnp.zeros(w.shape, jnp.float32), w_names))
  (total, dw), dx_NBCD = jax.lax.scan(body, init, (x_NBCD, targets_NBC, mask_NBC))
  dx_BTD = _unchunked(dx_NBCD, t)
  return total, (dx_BTD, dw.astype(w.dtype))


def _bwd(chunk_size, explicit_transpose_for_dw, vocab_axis, in_fp8, residuals, g):
  del chunk_size, explicit_transpose_for_dw, vocab_axis, in_fp8
  dx_BTD, dw_DV = residuals
  # Targets are integers and the mask is data: neither gets a gradient.
  return (g * dx_BTD).astype(dx_BTD.dtype), (g * dw_DV).astype(dw_DV.dtype), None, None


cross_entropy_sum.defvjp(_fwd, _bwd)


def chunked_cross_entropy(x_BTD, w, targets_BT, mask_BT, chunk_size: int,
                          explicit_transpose_for_dw: bool = False, vocab_axis: int = 1,
                          in_fp8: bool = False):
  """(sum of masked token losses, number of masked tokens), both float32."""
  return (cross_entropy_sum(x_BTD, w, targets_BT, mask_BT, chunk_size,
                            explicit_transpose_for_dw, vocab_axis, in_fp8),
          jnp.sum(mask_BT.astype(jnp.float32)))


def sequence_cross_entropy(x_BTD, w, targets_BT, mask_BT, chunk_size: int,
                           vocab_axis: int = 1):
  """[B] per-row sums of mask * cross-entropy, float32 (e.g. sequence log-probs for DPO).

  Per-row outputs get per-row cotangents, so dW cannot be formed in the forward pass as in
  `cross_entropy_sum`; here each chunk runs under remat instead, and the backward pass
  recomputes its logits. Memory is the same: [B, C, V] float32 at a time.
  """
  x_NBCD, targets_NBC, mask_NBC = _chunked(x_BTD, targets_BT, mask_BT, chunk_size)

  @jax.checkpoint
  def chunk_rows(x_BCD, targets_BC, mask_BC):
    logits_BCV = _head(x_BCD, w, vocab_axis)
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    onehot_BCV = jax.nn.one_hot(targets_BC, w.shape[vocab_axis], dtype=jnp.float32)
    target_logit_BC = jnp.sum(logits_BCV * onehot_BCV, axis=-1)
    return jnp.sum((lse_BC - target_logit_BC) * mask_BC, axis=-1)

  def body(total_B, xs):
    return total_B + chunk_rows(*xs), None

  total_B, _ = jax.lax.scan(body, jnp.zeros(x_BTD.shape[:1], jnp.float32),
                            (x_NBCD, targets_NBC, mask_NBC))
  return total_B


def token_cross_entropy(x_BTD, w, targets_BT, chunk_size: int, vocab_axis: int = 1,
                        vocab_limit: int | None = None, temperature: float = 1.0):
  """[B, T] float32 cross-entropy of every target token (e.g. GRPO's per-token log-probs).

  Chunked and rematerialized like `sequence_cross_entropy`: [B, C, V] float32 logits at a time.
  `vocab_limit`: the softmax over ids below it only (the tokenizer's real vocabulary, which the
  RL samplers draw from; the model's may be padded past it). `temperature`: the softmax of the
  float32 logits divided by it (the RL samplers' tempered distribution; dividing here, not the
  bfloat16 hidden states or head, keeps it the sampler's to float32 round-off).
  """
  t = x_BTD.shape[1]
  x_NBCD, targets_NBC, _ = _chunked(x_BTD, targets_BT, jnp.ones(targets_BT.shape), chunk_size)

  @jax.checkpoint
  def chunk_tokens(x_BCD, targets_BC):
    logits_BCV = _head(x_BCD, w, vocab_axis)
    if temperature != 1.0:
      logits_BCV = logits_BCV / temperature
    if vocab_limit is not None and vocab_limit < w.shape[vocab_axis]:
      real_V = jnp.arange(w.shape[vocab_axis]) < vocab_limit
      lse_BC = jax.nn.logsumexp(jnp.where(real_V, logits_BCV, -jnp.inf), axis=-1)
    else:
      lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    onehot_BCV = jax.nn.one_hot(targets_BC, w.shape[vocab_axis], dtype=jnp.float32)
    return lse_BC - jnp.sum(logits_BCV * onehot_BCV, axis=-1)

  nll_NBC = jax.lax.map(lambda xs: chunk_tokens(*xs), (x_NBCD, targets_NBC))
  return _unchunked(nll_NBC[..., None], t)[..., 0]
