"""FlashAttention-2 Pallas kernels (forward, dq, dk/dv) for GPU (Triton) and interpret mode.

The kernels see arrays already padded by the wrapper in `flash_attention.py`: T to a multiple of
block_q, S to a multiple of block_k. `FlashConfig` carries the true lengths so padded keys are
masked by position, never by a sentinel segment id.

Grids and blocks (B batch, H query heads, K kv heads, G = H / K; T, S padded):
- forward: grid (T / block_q, B, H). q and out blocks are [block_q, E] of head h; k and v are
  [S, E] windows of kv head h // G, read block_k rows at a time inside the loop (on GPU a window
  is only a pointer; nothing outside the loop's slices is loaded). lse block: [block_q] of
  float32 [B, H, T].
- dq: the same grid and blocks, plus do [block_q, E] and lse, delta [block_q].
- dk/dv: grid (S / block_k, B, K). k, v, dk, dv blocks are [block_k, E] of kv head k; q and do
  are [T, G, E] windows (the whole query group), lse and delta [G, T] windows.

Layout stays [B, T, H, E] (no transposes around the kernels). Grouped-query attention never
repeats K/V: the forward and dq kernels map query head h to kv head h // G in the BlockSpec
index_map; the dk/dv kernel runs once per kv head and loops over the G query heads of its group,
accumulating dk/dv in float32 registers, so no [B, S, H, E] temporary exists.

Sliding window (`FlashConfig.window` = W, causal only): query row i (at key position
i + S - T) sees key j iff 0 <= i + S - T - j < W.

Causal skipping bounds the in-kernel loops: a q block stops at the kv block holding its last
row's last visible key (forward, dq), and a kv block starts at the first q block that can see it
(dk/dv). With a window the other ends are bounded too: a q block starts at the kv block holding
its first row's first visible key, and a kv block stops after the last q block whose window
reaches its last key. Skipped blocks are neither loaded nor computed. Logits outside the mask
inside the visited blocks are set to a large finite negative, so no -inf - -inf NaN can arise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so the online-softmax rescale exp(m_old - m_new) never sees -inf - -inf; still small
# enough that exp(_MASK_VALUE - real logit) underflows to exactly 0.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Contract the last dim of both operands (x @ y.T) and the first dim of both (x.T @ y).
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class FlashConfig:
  """Static parameters shared by the three kernels (hashable: it is a jit/custom_vjp static).

  Attributes:
    causal: mask keys after the query, bottom-right aligned (offset s - t).
    window: sliding window W (needs causal): a query sees only its W most recent keys (its own
      included); None: no window.
    sm_scale: logit scale.
    t: true query length (before padding).
    s: true key length.
    block_q: rows of q per block; the padded T is a multiple of it.
    block_k: rows of k/v per block; the padded S is a multiple of it.
    interpret: run the kernels with the Pallas interpreter (any backend, CPU included).
    num_warps: Triton warps per program (GPU only).
    num_stages: Triton software-pipelining stages (GPU only).
    poison: test hook: outputs start as NaN (aliased inputs), proving every element is written.
  """
  causal: bool
  sm_scale: float
  t: int
  s: int
  block_q: int
  block_k: int
  interpret: bool = False
  num_warps: int | None = None
  num_stages: int | None = None
  poison: bool = False
  window: int | None = None

  @property
  def t_pad(self) -> int:
    return -(-self.t // self.block_q) * self.block_q

  @property
  def s_pad(self) -> int:
    return -(-self.s // self.block_k) * self.block_k

  def compiler_params(self):
    if self.interpret:
      return None
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _block_mask(cfg: FlashConfig, q_start, k_start, q_seg, k_seg):
  """Boolean [block_q, block_k] of visible logits, or None when every logit is visible."""
  masks = []
  if cfg.causal or cfg.s_pad != cfg.s:
    k_pos = k_start + jnp.arange(cfg.block_k, dtype=jnp.int32)[None, :]
  if cfg.causal:
    q_pos = q_start + jnp.arange(cfg.block_q, dtype=jnp.int32)[:, None]
    # How far the key lies behind the query's own (bottom-right aligned) position.
    behind_QK = q_pos + (cfg.s - cfg.t) - k_pos
    masks.append(behind_QK >= 0)
    if cfg.window is not None:
      masks.append(behind_QK < cfg.window)
  if cfg.s_pad != cfg.s:
    # Padded keys must never get probability, whatever their segment id or position.
    masks.append(k_pos < cfg.s)
  if q_seg is not None:
    masks.append(q_seg[:, None] == k_seg[None, :])
  return functools.reduce(jnp.logical_and, masks) if masks else None


def _logits(cfg: FlashConfig, q, k, mask):
  """Scaled float32 q @ k.T with invisible entries set to _MASK_VALUE."""
  s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * cfg.sm_scale
  return s if mask is None else jnp.where(mask, s, _MASK_VALUE)


def _num_kv_blocks(cfg: FlashConfig, q_block):
  """How many kv blocks a q block visits: all, or up to its last row's last visible key."""
  n = cfg.s_pad // cfg.block_k
  if not cfg.causal:
    return n
  last_key_excl = (q_block + 1) * cfg.block_q + (cfg.s - cfg.t)
  return jnp.minimum(n, lax.div(last_key_excl + cfg.block_k - 1, cfg.block_k))


def _first_kv_block(cfg: FlashConfig, q_block):
  """First kv block a q block visits: the one holding its first row's first visible key (0
  without a window)."""
  if cfg.window is None:
    return 0
  first_key = q_block * cfg.block_q + (cfg.s - cfg.t) - cfg.window + 1
  return lax.div(jnp.maximum(first_key, 0), cfg.block_k)


def _first_q_block(cfg: FlashConfig, kv_block):
  """First q block that sees any key of kv block `kv_block` (0 unless causal)."""
  if not cfg.causal:
    return 0
  first_row = jnp.maximum(kv_block * cfg.block_k - (cfg.s - cfg.t), 0)
  return lax.div(first_row, cfg.block_q)


def _num_q_blocks(cfg: FlashConfig, kv_block):
  """End (exclusive) of the q blocks that see kv block `kv_block`: all of them, or, with a
  window, up to the block holding the last row whose window still reaches its last key."""
  n = cfg.t_pad // cfg.block_q
  if cfg.window is None:
    return n
  last_row_excl = (kv_block + 1) * cfg.block_k - (cfg.s - cfg.t) + cfg.window - 1
  # Clamped at 0: with S > T a kv block can lie before every query's window (empty loop).
  return jnp.minimum(n, lax.div(jnp.maximum(last_row_excl, 0) + cfg.block_q - 1, cfg.block_q))


def _split_refs(refs, n_in, n_out):
  """Drops the poison inputs (never read: they only seed the aliased outputs)."""
  return refs[:n_in], refs[len(refs) - n_out:]


def _call(kernel, cfg: FlashConfig, *, grid, in_specs, out_specs, out_shape, args, name):
  """pallas_call, with NaN-filled outputs aliased in when cfg.poison is set."""
  aliases = {}
  if cfg.poison:
    poison = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    aliases = {len(args) + i: i for i in range(len(out_shape))}
    in_specs = [*in_specs, *out_specs]
    args = [*args, *poison]
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, interpret=cfg.interpret,
      compiler_params=cfg.compiler_params(), name=name)(*args)


def _fwd_kernel(*refs, cfg: FlashConfig, has_seg: bool):
  n_in = 5 if has_seg else 3
  ins, (o_ref, lse_ref) = _split_refs(refs, n_in, 2)
  q_ref, k_ref, v_ref = ins[:3]
  qseg_ref, kseg_ref = ins[3:] if has_seg else (None, None)
  q_block = pl.program_id(0)
  q_start = q_block * cfg.block_q
  q_QE = q_ref[...]
  qseg_Q = qseg_ref[...] if has_seg else None

  def body(kv_block, carry):
    acc_QE, m_Q, l_Q = carry
    k_start = kv_block * cfg.block_k
    kv_rows = pl.ds(k_start, cfg.block_k)
    k_KE, v_KE = k_ref[kv_rows, :], v_ref[kv_rows, :]
    kseg_K = kseg_ref[kv_rows] if has_seg else None
    s_QK = _logits(cfg, q_QE, k_KE, _block_mask(cfg, q_start, k_start, qseg_Q, kseg_K))
    m_new_Q = jnp.maximum(m_Q, jnp.max(s_QK, axis=1))
    # Rescale what was accumulated under the old running max (FlashAttention-2, Alg. 1).
    alpha_Q = jnp.exp(m_Q - m_new_Q)
    p_QK = jnp.exp(s_QK - m_new_Q[:, None])
    l_new_Q = alpha_Q * l_Q + jnp.sum(p_QK, axis=1)
    pv_QE = lax.dot_general(p_QK.astype(v_KE.dtype), v_KE, _NN,
                            preferred_element_type=jnp.float32)
    return alpha_Q[:, None] * acc_QE + pv_QE, m_new_Q, l_new_Q

  e = q_QE.shape[-1]
  init = (jnp.zeros((cfg.block_q, e), jnp.float32),
          jnp.full((cfg.block_q,), _MASK_VALUE, jnp.float32),
          jnp.zeros((cfg.block_q,), jnp.float32))
  acc_QE, m_Q, l_Q = lax.fori_loop(_first_kv_block(cfg, q_block), _num_kv_blocks(cfg, q_block),
                                   body, init)
  # l >= 1: the row max contributes exp(0). Every q block holds a real row, which sees its own
  # key, so the loop is never empty; rows that see no key in it (padding) average finitely.
  o_ref[...] = (acc_QE / l_Q[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m_Q + jnp.log(l_Q)


def forward(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, cfg: FlashConfig):
  """Padded forward: returns out [B, T, H, E] (q dtype) and float32 lse [B, H, T]."""
  b, t, h, e = q_BTHE.shape
  s, kh = k_BSKE.shape[1], k_BSKE.shape[2]
  g = h // kh
  has_seg = qseg_BT is not None
  q_spec = pl.BlockSpec((None, cfg.block_q, None, e), lambda i, bi, hi: (bi, i, hi, 0))
  kv_spec = pl.BlockSpec((None, s, None, e), lambda i, bi, hi: (bi, 0, hi // g, 0))
  in_specs = [q_spec, kv_spec, kv_spec]
  args = [q_BTHE, k_BSKE, v_BSKE]
  if has_seg:
    in_specs += [pl.BlockSpec((None, cfg.block_q), lambda i, bi, hi: (bi, i)),
                 pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))]
    args += [qseg_BT, kseg_BS]
  out_specs = [q_spec, pl.BlockSpec((None, None, cfg.block_q), lambda i, bi, hi: (bi, hi, i))]
  out_shape = [jax.ShapeDtypeStruct(q_BTHE.shape, q_BTHE.dtype),
               jax.ShapeDtypeStruct((b, h, t), jnp.float32)]
  out_BTHE, lse_BHT = _call(
      functools.partial(_fwd_kernel, cfg=cfg, has_seg=has_seg), cfg,
      grid=(t // cfg.block_q, b, h), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, args=args, name="flash_attention_fwd")
  return out_BTHE, lse_BHT


def _dq_kernel(*refs, cfg: FlashConfig, has_seg: bool):
  n_in = 8 if has_seg else 6
  ins, (dq_ref,) = _split_refs(refs, n_in, 1)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins[:6]
  qseg_ref, kseg_ref = ins[6:] if has_seg else (None, None)
  q_block = pl.program_id(0)
  q_start = q_block * cfg.block_q
  q_QE, do_QE = q_ref[...], do_ref[...]
  lse_Q, delta_Q = lse_ref[...], delta_ref[...]
  qseg_Q = qseg_ref[...] if has_seg else None

  def body(kv_block, dq_QE):
    k_start = kv_block * cfg.block_k
    kv_rows = pl.ds(k_start, cfg.block_k)
    k_KE, v_KE = k_ref[kv_rows, :], v_ref[kv_rows, :]
    kseg_K = kseg_ref[kv_rows] if has_seg else None
    s_QK = _logits(cfg, q_QE, k_KE, _block_mask(cfg, q_start, k_start, qseg_Q, kseg_K))
    # Probabilities recomputed from the saved row log-sum-exp: exact, no second max pass.
    p_QK = jnp.exp(s_QK - lse_Q[:, None])
    dp_QK = lax.dot_general(do_QE, v_KE, _NT, preferred_element_type=jnp.float32)
    ds_QK = p_QK * (dp_QK - delta_Q[:, None])
    return dq_QE + lax.dot_general(ds_QK.astype(k_KE.dtype), k_KE, _NN,
                                   preferred_element_type=jnp.float32)

  dq_QE = lax.fori_loop(_first_kv_block(cfg, q_block), _num_kv_blocks(cfg, q_block), body,
                        jnp.zeros(q_QE.shape, jnp.float32))
  dq_ref[...] = (dq_QE * cfg.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: FlashConfig, has_seg: bool, groups: int):
  n_in = 8 if has_seg else 6
  ins, (dk_ref, dv_ref) = _split_refs(refs, n_in, 2)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins[:6]
  qseg_ref, kseg_ref = ins[6:] if has_seg else (None, None)
  kv_block = pl.program_id(0)
  k_start = kv_block * cfg.block_k
  k_KE, v_KE = k_ref[...], v_ref[...]
  kseg_K = kseg_ref[...] if has_seg else None

  def q_body(q_block, carry):
    q_start = q_block * cfg.block_q
    q_rows = pl.ds(q_start, cfg.block_q)
    qseg_Q = qseg_ref[q_rows] if has_seg else None
    # One mask per (q block, kv block), shared by the G query heads of this kv head.
    mask_QK = _block_mask(cfg, q_start, k_start, qseg_Q, kseg_K)

    def head_body(g, carry):
      dk_KE, dv_KE = carry
      q_QE, do_QE = q_ref[q_rows, g, :], do_ref[q_rows, g, :]
      lse_Q, delta_Q = lse_ref[g, q_rows], delta_ref[g, q_rows]
      p_QK = jnp.exp(_logits(cfg, q_QE, k_KE, mask_QK) - lse_Q[:, None])
      dv_KE += lax.dot_general(p_QK.astype(do_QE.dtype), do_QE, _TN,
                               preferred_element_type=jnp.float32)
      dp_QK = lax.dot_general(do_QE, v_KE, _NT, preferred_element_type=jnp.float32)
      ds_QK = p_QK * (dp_QK - delta_Q[:, None])
      dk_KE += lax.dot_general(ds_QK.astype(q_QE.dtype), q_QE, _TN,
                               preferred_element_type=jnp.float32)
      return dk_KE, dv_KE

    if groups == 1:
      return head_body(0, carry)
    return lax.fori_loop(0, groups, head_body, carry)

  zeros_KE = jnp.zeros(k_KE.shape, jnp.float32)
  dk_KE, dv_KE = lax.fori_loop(_first_q_block(cfg, kv_block), _num_q_blocks(cfg, kv_block),
                               q_body, (zeros_KE, zeros_KE))
  dk_ref[...] = (dk_KE * cfg.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_KE.astype(dv_ref.dtype)


def backward(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, out_BTHE, lse_BHT, do_BTHE,
             cfg: FlashConfig):
  """Padded backward: returns dq, dk, dv in the dtypes of q, k, v."""
  b, t, h, e = q_BTHE.shape
  s, kh = k_BSKE.shape[1], k_BSKE.shape[2]
  g = h // kh
  has_seg = qseg_BT is not None
  # delta = rowsum(dO * O): one fused XLA reduction, read by both kernels.
  delta_BHT = jnp.einsum("BTHE,BTHE->BHT", out_BTHE.astype(jnp.float32),
                         do_BTHE.astype(jnp.float32))
  args = [q_BTHE, k_BSKE, v_BSKE, do_BTHE, lse_BHT, delta_BHT]
  if has_seg:
    args += [qseg_BT, kseg_BS]

  # dq: one program per (q block, batch, query head), looping over visible kv blocks.
  q_spec = pl.BlockSpec((None, cfg.block_q, None, e), lambda i, bi, hi: (bi, i, hi, 0))
  kv_spec = pl.BlockSpec((None, s, None, e), lambda i, bi, hi: (bi, 0, hi // g, 0))
  row_spec = pl.BlockSpec((None, None, cfg.block_q), lambda i, bi, hi: (bi, hi, i))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  if has_seg:
    in_specs += [pl.BlockSpec((None, cfg.block_q), lambda i, bi, hi: (bi, i)),
                 pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))]
  (dq_BTHE,) = _call(
      functools.partial(_dq_kernel, cfg=cfg, has_seg=has_seg), cfg,
      grid=(t // cfg.block_q, b, h), in_specs=in_specs, out_specs=[q_spec],
      out_shape=[jax.ShapeDtypeStruct(q_BTHE.shape, q_BTHE.dtype)], args=args,
      name="flash_attention_bwd_dq")

  # dk/dv: one program per (kv block, batch, kv head); the whole query group of that kv head
  # (G heads x all of T) is visible to it, and the loops skip q blocks the causal mask (and the
  # window) hides.
  group_spec = pl.BlockSpec((None, t, g, e), lambda j, bi, ki: (bi, 0, ki, 0))
  kv_spec = pl.BlockSpec((None, cfg.block_k, None, e), lambda j, bi, ki: (bi, j, ki, 0))
  rows_spec = pl.BlockSpec((None, g, t), lambda j, bi, ki: (bi, ki, 0))
  in_specs = [group_spec, kv_spec, kv_spec, group_spec, rows_spec, rows_spec]
  if has_seg:
    in_specs += [pl.BlockSpec((None, t), lambda j, bi, ki: (bi, 0)),
                 pl.BlockSpec((None, cfg.block_k), lambda j, bi, ki: (bi, j))]
  dk_BSKE, dv_BSKE = _call(
      functools.partial(_dkdv_kernel, cfg=cfg, has_seg=has_seg, groups=g), cfg,
      grid=(s // cfg.block_k, b, kh), in_specs=in_specs, out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k_BSKE.shape, k_BSKE.dtype),
                 jax.ShapeDtypeStruct(v_BSKE.shape, v_BSKE.dtype)],
      args=args, name="flash_attention_bwd_dkdv")
  return dq_BTHE, dk_BSKE, dv_BSKE
