"""Flash attention for jaxtrain: one signature, a Pallas kernel per backend, exact gradients.

`flash_attention(q, k, v, causal=, segment_ids=, window=, ...)` computes the same function as
`jaxtrain.ops.attention.xla_attention` without ever materializing [T, S] logits, and without
repeating K/V for grouped-query attention (K kv heads serving H = K * G query heads).

Routes:
- GPU: our FlashAttention-2 kernels (`flash_attention_kernels.py`) through Pallas' Triton
  lowering. Forward saves out and the float32 row log-sum-exp; the backward (a `jax.custom_vjp`)
  recomputes probabilities from it in a dq kernel and a dk/dv kernel.
- TPU: jax's splash attention (`splash_tpu.py`), which fits this signature without repeating K/V.
- interpret=True: the Pallas interpreter runs the GPU kernels anywhere (CPU included); on a TPU
  host it interprets the splash route instead.
- CPU without interpret: a ValueError (use interpret=True, or attention.impl="xla").

Semantics: causal masks are bottom-right aligned (query i sees keys j <= i + S - T), so S >= T is
required when causal; segment_ids [B, T] means packed self-attention (S == T) where a token sees
only tokens with an equal id (0, padding in the trainer, is an ordinary id); `window` W (causal
only; Hugging Face's sliding window) keeps the W most recent keys of each query, its own
included: query i sees key j iff 0 <= i + S - T - j < W. T and S need not be
multiples of the blocks: inputs are padded here, padded keys are masked by position and the
output is sliced. On GPU the head dim E must be a power of two in [16, 256] (Triton tensor
shapes); interpret mode takes any E. Softmax statistics and accumulators are float32 always;
float32 inputs are multiplied in TF32 on GPU (JAX's default matmul precision).

Untested here (this project's machines have no GPU or TPU): Triton's compilation to PTX and GPU
execution of our kernels (the tests only lower them for CUDA and run the MLIR verifier on the
Triton modules), the default GPU block sizes and warp counts (not tuned), and the TPU route
beyond interpret mode and jax-level Mosaic lowering. Numerics were verified in interpret mode
against `reference_attention`.

Inside a sharded jit, call this under shard_map: XLA cannot partition a Pallas custom call, so
give it per-device shards (batch and heads split; T and S whole).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from kernels_pallas import flash_attention_kernels as fk
from kernels_pallas import splash_tpu

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Routes: our FlashAttention-2 kernels (Triton / interpreter) or splash attention (Mosaic TPU).
_FLASH, _SPLASH = "flash", "splash"


def flash_attention(q, k, v, *, causal=True, segment_ids=None, sm_scale=None, interpret=False,
                    block_q=None, block_k=None, platform=None, window=None):
  """Memory-efficient attention; returns [B, T, H, E] in q's dtype.

  Args:
    q: queries [B, T, H, E].
    k: keys [B, S, K, E]; K divides H and query head h reads kv head h // (H // K).
    v: values [B, S, K, E], same dtype as q and k (float32, bfloat16 or float16).
    causal: mask keys after the query, aligned bottom-right; needs S >= T.
    segment_ids: optional int [B, T] document ids for packed self-attention (needs S == T): a
      token attends only to tokens with the same id. No gradient flows to them.
    window: optional sliding window W, a positive int (needs causal=True): a query sees only
      the W most recent keys up to its own position (query i sees key j iff
      0 <= i + S - T - j < W). Blocks wholly outside every window are skipped. None: no window.
    sm_scale: static logit scale, E**-0.5 by default.
    interpret: run the Pallas interpreter (slow; any backend, needed on CPU).
    block_q: query rows per block (power of two >= 16 on GPU, multiple of 128 on TPU).
    block_k: key rows per block (same constraints as block_q).
    platform: what the program compiles for, "gpu" (Triton), "tpu" (splash) or "cpu"; default:
      the devices of the mesh set with `jax.set_mesh`, else this process's backend. A CPU
      process compiling for a deviceless GPU or TPU target passes its target's.

  Raises:
    ValueError: bad shapes, dtypes, block sizes or window, or CPU without interpret=True.
  """
  check_window(window, causal)  # before jit, which would reject a traced window less clearly
  return _attention(q, k, v, segment_ids, causal=causal, sm_scale=sm_scale,
                    interpret=interpret, block_q=block_q, block_k=block_k,
                    platform=platform or current_platform(), window=window)


def current_platform() -> str:
  """"gpu", "tpu" or "cpu": the devices of the concrete mesh set with `jax.set_mesh` (seen only
  outside jit: callers that trace under jit pass `platform=`), else this process's backend."""
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # inside jit, where only the abstract mesh (no devices) is known
    mesh = None
  name = jax.default_backend() if mesh is None or mesh.empty else mesh.devices.flat[0].platform
  return "gpu" if name in ("gpu", "cuda", "rocm") else name


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def check_window(window, causal) -> None:
  """Raises ValueError unless `window` is None or a positive int used with causal attention."""
  if window is None:
    return
  if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window <= 0:
    raise ValueError(f"window must be a positive int (a static sliding-window size) or None, "
                     f"got {window!r}")
  if not causal:
    raise ValueError(f"window={window} needs causal=True: a sliding window keeps the keys "
                     f"before each query, so it is defined for causal attention only")


def _check_block(name: str, value, route: str, platform: str, interpret: bool):
  if value is None:
    return
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  if route == _SPLASH and value % 128:
    raise ValueError(f"{name}={value}: the TPU (splash) route needs a multiple of 128")
  if route == _FLASH and platform == "gpu" and not interpret and (
      not _is_pow2(value) or value < 16):
    raise ValueError(f"{name}={value}: the GPU (Triton) kernels need a power of two >= 16")


def _validate(q, k, v, segment_ids, *, causal, sm_scale, interpret, block_q, block_k, route,
              platform, window=None):
  """Raises ValueError naming the first bad argument."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be 4-D ([B, T, H, E] / [B, S, K, E]), got shape "
                       f"{getattr(x, 'shape', type(x))}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
  (b, t, h, e), (bk, s, kh, ek) = q.shape, k.shape
  if bk != b:
    raise ValueError(f"batch sizes differ: q has {b}, k/v have {bk}")
  if ek != e:
    raise ValueError(f"head dims differ: q has E={e}, k/v have E={ek}")
  if min(b, t, h, e, s, kh) == 0:
    raise ValueError(f"empty input: q {q.shape}, k/v {k.shape}")
  if h % kh:
    raise ValueError(f"kv heads K={kh} must divide query heads H={h} (grouped-query attention)")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if q.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"dtype {q.dtype} is unsupported; use float32, bfloat16 or float16")
  if not isinstance(causal, bool):
    raise ValueError(f"causal must be a bool, got {causal!r}")
  if not isinstance(interpret, bool):
    raise ValueError(f"interpret must be a bool, got {interpret!r}")
  if sm_scale is not None and (not isinstance(sm_scale, numbers.Real)
                               or isinstance(sm_scale, bool) or not math.isfinite(sm_scale)):
    raise ValueError(f"sm_scale must be a finite Python float (static), got {sm_scale!r}")
  check_window(window, causal)
  if causal and s < t:
    raise ValueError(f"causal attention needs S >= T (bottom-right aligned mask), got T={t}, "
                     f"S={s}: the first {t - s} query rows would see no key")
  if segment_ids is not None:
    if getattr(segment_ids, "shape", None) != (b, t):
      raise ValueError(f"segment_ids must have shape [B, T] = {(b, t)}, got "
                       f"{getattr(segment_ids, 'shape', type(segment_ids))}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")
    if s != t:
      raise ValueError(f"segment_ids mean packed self-attention and need S == T, got T={t}, "
                       f"S={s}")
  if route == _FLASH and platform == "gpu" and not interpret and (not _is_pow2(e) or
                                                                   not 16 <= e <= 256):
    raise ValueError(f"head dim E={e}: the GPU (Triton) kernels need a power of two in [16, 256]")
  _check_block("block_q", block_q, route, platform, interpret)
  _check_block("block_k", block_k, route, platform, interpret)


def _default_blocks(route: str, platform: str, interpret: bool, e: int, t: int, s: int):
  """Per-backend defaults (block_q, block_k), shrunk for short sequences."""
  if route == _SPLASH:
    return 128, 128
  if interpret:
    # Small blocks keep interpreted runs quick and still exercise multi-block loops.
    bq, bk = 32, 32
  else:
    # Triton: fits the float32 accumulators of one q block in registers for E <= 128.
    bq, bk = (128, 64) if e <= 128 else (64, 32)
  return min(bq, max(16, _next_pow2(t))), min(bk, max(16, _next_pow2(s)))


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "interpret", "block_q",
                                             "block_k", "route", "poison", "platform",
                                             "window"))
def _attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, causal=True, sm_scale=None,
               interpret=False, block_q=None, block_k=None, route=None, poison=False,
               platform=None, window=None):
  """`flash_attention` plus two test hooks.

  `route` forces "flash" (our kernels) or "splash" (the TPU route) whatever the backend, so both
  can be interpreted on CPU. `poison` (flash route only) seeds every kernel output with NaN, so an
  element no program writes would show.
  """
  platform = platform or current_platform()
  if platform not in ("gpu", "tpu") and not interpret:
    raise ValueError(f"flash_attention has no compiled Pallas kernel for backend {platform!r}; "
                     f"pass interpret=True (slow, for tests) or use attention.impl='xla'")
  route = route or (_SPLASH if platform == "tpu" else _FLASH)
  if route not in (_FLASH, _SPLASH):
    raise ValueError(f"route must be {_FLASH!r} or {_SPLASH!r}, got {route!r}")
  _validate(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, causal=causal, sm_scale=sm_scale,
            interpret=interpret, block_q=block_q, block_k=block_k, route=route,
            platform=platform, window=window)
  window = None if window is None else int(window)  # numpy ints too: one static, hashable type
  b, t, h, e = q_BTHE.shape
  s = k_BSKE.shape[1]
  sm_scale = float(e ** -0.5 if sm_scale is None else sm_scale)
  default_q, default_k = _default_blocks(route, platform, interpret, e, t, s)
  block_q, block_k = block_q or default_q, block_k or default_k

  if route == _SPLASH:
    return splash_tpu.splash_attention(
        q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, causal=causal, sm_scale=sm_scale,
        block_q=block_q, block_k=block_k, interpret=interpret, window=window)

  cfg = fk.FlashConfig(
      causal=causal, sm_scale=sm_scale, t=t, s=s, block_q=block_q, block_k=block_k,
      interpret=interpret, num_warps=4 if e <= 64 else 8, num_stages=2, poison=poison,
      window=window)
  # Pad here, outside the custom_vjp, so autodiff of pad/slice hands the kernels a cotangent
  # that is zero on padded rows: they then add nothing to dk/dv.
  pad_t, pad_s = cfg.t_pad - t, cfg.s_pad - s
  q_BTHE = jnp.pad(q_BTHE, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
  k_BSKE, v_BSKE = (jnp.pad(x, ((0, 0), (0, pad_s), (0, 0), (0, 0))) for x in (k_BSKE, v_BSKE))
  qseg_BT = kseg_BS = None
  if segment_ids_BT is not None:
    # Pad values are irrelevant: padded keys are masked by position, padded rows are dropped.
    ids_BT = segment_ids_BT.astype(jnp.int32)
    qseg_BT, kseg_BS = jnp.pad(ids_BT, ((0, 0), (0, pad_t))), jnp.pad(ids_BT, ((0, 0), (0, pad_s)))
  out_BTHE = _flash(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, cfg)
  return out_BTHE[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, cfg):
  out_BTHE, _ = fk.forward(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, cfg)
  return out_BTHE


def _flash_fwd(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, cfg):
  out_BTHE, lse_BHT = fk.forward(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, cfg)
  return out_BTHE, (q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, out_BTHE, lse_BHT)


def _flash_bwd(cfg, residuals, do_BTHE):
  q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, out_BTHE, lse_BHT = residuals
  dq_BTHE, dk_BSKE, dv_BSKE = fk.backward(q_BTHE, k_BSKE, v_BSKE, qseg_BT, kseg_BS, out_BTHE,
                                          lse_BHT, do_BTHE, cfg)
  # Segment ids are integers: no cotangent (None is custom_vjp's zero).
  return dq_BTHE, dk_BSKE, dv_BSKE, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
