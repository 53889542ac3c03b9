"""Attention over packed sequences: one signature, several implementations.

- `xla`: the reference, plain jnp einsums with a float32 softmax (materializes [T, S] scores).
- `pallas`: our flash-attention kernels (kernels_pallas): Triton on GPU, splash attention on
  TPU, the Pallas interpreter anywhere with `interpret=True` (slow: for tests on CPU).
- `cudnn`: `jax.nn.dot_product_attention` with cuDNN's fused kernel (GPU only).
- `auto`: cuDNN on GPU, pallas on TPU, xla on CPU.
- `blockwise` (internal, not a config choice): flash-style blocks in plain jnp, exact, memory
  linear in T; the dry run's stand-in for the fused kernels, which XLA:CPU cannot compile.

Shapes: q_BTHE, k_BSKE, v_BSKE with K kv heads dividing H query heads (grouped-query attention;
K/V are never repeated in memory: queries are regrouped as [B, T, K, G, E]). `segment_ids_BT`
marks packed documents (0 = padding): a token attends only to earlier tokens of its own segment.
`window` W (causal only; None: none) is a sliding window as in Hugging Face's
`sliding_window_overlay`: query i sees key j iff 0 <= i + S - T - j < W, i.e. its W most recent
keys, its own included (array-index distance, which inside a packed document is position
distance). Every impl takes it; context parallelism does not (a ValueError).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from jaxtrain.ops.blockwise_attention import blockwise_attention
from jaxtrain.parallel.context_attention import context_attention
from jaxtrain.parallel.context_parallel import context_size
from jaxtrain.parallel.mesh import logical_to_spec
from jaxtrain.parallel.pipeline import stage_count
from kernels_pallas.flash_attention import check_window, current_platform, flash_attention

IMPLS = ("xla", "pallas", "cudnn", "auto")
_CONTEXT_WINDOW_ERROR = ("sliding-window attention (model.sliding_window) under context "
                         "parallelism (mesh.context > 1) is not supported; use mesh.context=1")
_AUTO = {"gpu": "cudnn", "tpu": "pallas"}
# cuDNN's fused (flash) attention takes query/key head dims up to 128, in multiples of 8.
CUDNN_MAX_HEAD_DIM = 128


def cudnn_takes(head_dim: int) -> bool:
  return head_dim <= CUDNN_MAX_HEAD_DIM and head_dim % 8 == 0


def resolve_impl(impl: str, platform: str | None = None, interpret: bool = False,
                 head_dim: int | None = None) -> str:
  """Maps `auto` to the best implementation for `platform` (what the program compiles for:
  "cpu", "gpu", "tpu"; default: the current mesh's devices, else this process's backend) and
  `head_dim` (the queries'; on GPU, head dims cuDNN does not take get our Pallas kernels);
  refuses ones it lacks."""
  platform = platform or current_platform()
  if impl == "auto":
    best = _AUTO.get(platform, "xla")
    if best == "cudnn" and head_dim is not None and not cudnn_takes(head_dim):
      return "pallas"
    return best
  if impl == "cudnn" and head_dim is not None and not cudnn_takes(head_dim):
    raise ValueError(f"attention impl 'cudnn': cuDNN's fused attention takes head dims up to "
                     f"{CUDNN_MAX_HEAD_DIM} in multiples of 8, not {head_dim}; use 'pallas' or "
                     f"'auto'")
  if impl == "blockwise":
    return impl
  if impl not in IMPLS:
    raise ValueError(f"attention impl {impl!r} is unknown; choose one of {', '.join(IMPLS)}")
  if impl == "cudnn" and platform != "gpu":
    raise ValueError(f"attention impl 'cudnn' needs a GPU backend (this is {platform!r}); use "
                     f"'xla' or 'auto'")
  if impl == "pallas" and platform not in ("gpu", "tpu") and not interpret:
    raise ValueError(f"attention impl 'pallas' compiles for GPU or TPU (this is {platform!r}); "
                     f"set attention.interpret=True to run the kernels in the Pallas interpreter "
                     f"(slow, for tests), or use 'xla'")
  return impl


def kernel_head_dim(impl: str, platform: str, interpret: bool, head_dim: int) -> int:
  """The head dim `impl` computes `head_dim` at: our GPU (Triton) kernels take powers of two
  from 16, so others are padded up to the next one; the rest take it as it is."""
  if impl == "pallas" and platform == "gpu" and not interpret:
    return max(16, 1 << (head_dim - 1).bit_length())
  return head_dim


def attention_mask(segment_ids_BT: jax.Array | None, t: int, s: int, causal: bool = True,
                   window: int | None = None) -> jax.Array:
  """Boolean [B or 1, 1, T, S]: causal, within the sliding window (needs causal) and
  same-segment. Every row keeps its diagonal."""
  check_window(window, causal)
  mask_TS = jnp.ones((t, s), dtype=bool)
  if causal:
    mask_TS = jnp.tril(mask_TS, k=s - t)
  if window is not None:
    mask_TS = jnp.triu(mask_TS, k=s - t - window + 1)  # key j >= (i + s - t) - window + 1
  mask = mask_TS[None, None]
  if segment_ids_BT is not None:
    same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    mask = mask & same_BTS[:, None]
  return mask


def xla_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, causal=True, sm_scale=None,
                  window=None):
  """Reference attention in plain jnp: float32 softmax, GQA without repeating K/V.

  Heads-major inside: the G query heads of a kv head are stacked along the query axis
  ([B, K, G*T, E]), so both products are plain batched matmuls over (B, K). Against a 5-D
  [B, T, K, G, E] einsum this halves XLA:CPU's forward + backward time (52 -> 29 ms at
  B=4, T=256, H=8, E=64), with identical results.
  """
  b, t, h, e = q_BTHE.shape
  s, k = k_BSKE.shape[1], k_BSKE.shape[2]
  g = h // k
  sm_scale = e ** -0.5 if sm_scale is None else sm_scale
  q_BKME = q_BTHE.reshape(b, t, k, g, e).transpose(0, 2, 3, 1, 4).reshape(b, k, g * t, e)
  k_BKSE, v_BKSE = k_BSKE.transpose(0, 2, 1, 3), v_BSKE.transpose(0, 2, 1, 3)
  logits_BKMS = jnp.einsum("BKME,BKSE->BKMS", q_BKME, k_BKSE,
                           preferred_element_type=jnp.float32) * sm_scale
  logits_BKGTS = logits_BKMS.reshape(b, k, g, t, s)
  mask_B11TS = attention_mask(segment_ids_BT, t, s, causal, window)[:, :, None]
  logits_BKGTS = jnp.where(mask_B11TS, logits_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKMS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKE.dtype).reshape(b, k, g * t, s)
  ev = v_BSKE.shape[-1]  # the values' head dim may differ from the queries' (MLA)
  out_BKGTE = jnp.einsum("BKMS,BKSE->BKME", probs_BKMS, v_BKSE).reshape(b, k, g, t, ev)
  return out_BKGTE.transpose(0, 3, 1, 2, 4).reshape(b, t, h, ev)


def _cache_window_mask(behind_BCS, window):
  """Boolean [B, C, S] of keys less than `window` positions behind their query, or None when
  `window` (None, an int or a traced int32 scalar; <= 0: no window) is statically no window."""
  if window is None:
    return None
  if isinstance(window, numbers.Integral):
    return behind_BCS < window if window > 0 else None
  # Traced (a per-layer value inside a scan over layers): global layers pass 0 at run time.
  return (behind_BCS < window) | (window <= 0)


def cached_attention(q_BCHE, k_BSKE, v_BSKE, positions_BC, dtype, *, window=None,
                     sm_scale=None) -> jax.Array:
  """C new queries per row against a KV cache of S positions (generation): each query sees the
  cached keys at or before its own position, so a cache's unwritten tail never leaks in.
  Scores and softmax in float32, the weighted sum in `dtype`.

  `window`: None, an int or a traced int32 scalar (a per-layer value from inside a scan): the
  query at position p sees cache position j iff j <= p and p - j < window; a value <= 0 means
  no window. `sm_scale`: the logit scale, E**-0.5 by default.
  """
  b, c, h, e = q_BCHE.shape
  s, k = k_BSKE.shape[1], k_BSKE.shape[2]
  sm_scale = e ** -0.5 if sm_scale is None else sm_scale
  q_BCKGE = q_BCHE.reshape(b, c, k, h // k, e)
  logits_BKGCS = jnp.einsum("BCKGE,BSKE->BKGCS", q_BCKGE, k_BSKE.astype(dtype),
                            preferred_element_type=jnp.float32) * sm_scale
  behind_BCS = positions_BC[:, :, None] - jnp.arange(s)[None, None, :]
  visible_BCS = behind_BCS >= 0
  window_BCS = _cache_window_mask(behind_BCS, window)
  if window_BCS is not None:
    visible_BCS &= window_BCS
  logits_BKGCS = jnp.where(visible_BCS[:, None, None], logits_BKGCS, jnp.finfo(jnp.float32).min)
  probs_BKGCS = jax.nn.softmax(logits_BKGCS, axis=-1).astype(dtype)
  return jnp.einsum("BKGCS,BSKE->BCKGE", probs_BKGCS,
                    v_BSKE.astype(dtype)).reshape(b, c, h, v_BSKE.shape[-1])


def cudnn_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, causal=True, sm_scale=None,
                    window=None):
  """cuDNN's fused kernel. A window becomes jax's local_window_size (W - 1, 0): W - 1 keys left
  of the diagonal, none right; cuDNN's sliding_window_length W, keys in (i - W, i]."""
  check_window(window, causal)
  mask = None
  if segment_ids_BT is not None:
    mask = attention_mask(segment_ids_BT, q_BTHE.shape[1], k_BSKE.shape[1], causal=False)
  local_window_size = None if window is None else (window - 1, 0)
  return jax.nn.dot_product_attention(q_BTHE, k_BSKE, v_BSKE, mask=mask, scale=sm_scale,
                                      is_causal=causal, local_window_size=local_window_size,
                                      implementation="cudnn")


def pallas_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, causal=True,
                     sm_scale=None, interpret=False, block_q=None, block_k=None, platform=None,
                     window=None):
  """The flash-attention kernels, run per shard under a mesh.

  A pallas_call is opaque to XLA's SPMD partitioner, so under a mesh it runs inside shard_map:
  each device attends over its own rows (batch split over the data-parallel axes) and its own
  heads (split over `tensor`). Query heads and kv heads are split alike, so local query head j
  still reads local kv head j // G: grouped-query attention needs no communication.
  """
  def local(q, k, v, seg):
    return flash_attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=sm_scale,
                           interpret=interpret, block_q=block_q, block_k=block_k,
                           platform=platform, window=window)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT)
  q_spec = logical_to_spec(("act_batch", None, "act_heads", None))
  kv_spec = logical_to_spec(("act_batch", None, "act_kv_heads", None))
  if segment_ids_BT is None:
    return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh,
                         in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)(q_BTHE, k_BSKE, v_BSKE)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(q_spec, kv_spec, kv_spec, logical_to_spec(("act_batch", None))),
                       out_specs=q_spec, check_vma=False)(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT)


def impl_under_stages(impl: str, stages: int) -> str:
  """The resolved impl that runs under `stages` pipeline stages: pipeline stages vmap the layers,
  and JAX's batching rule for cuDNN attention cannot batch its segment mask ("cannot reshape
  array of shape (S, B, 1, T, T)"), so `cudnn` becomes our kernels there."""
  return "pallas" if impl == "cudnn" and stages > 1 else impl


def impl_that_runs(impl: str, platform: str, head_dim: int, stages: int) -> str:
  """What attention `impl` becomes in a step compiled for `platform` with queries of `head_dim`
  under `stages` pipeline stages: `auto` resolved (resolve_impl), then cuDNN under stages
  (impl_under_stages). An explicit impl is kept as named: validation checks it."""
  resolved = resolve_impl(impl, platform, head_dim=head_dim) if impl == "auto" else impl
  return impl_under_stages(resolved, stages)


def context_kernel_platform(impl: str, platform: str, interpret: bool = False) -> str | None:
  """Where context-parallel attention runs our Pallas kernels per chunk pair: "gpu" for a fused
  impl on GPU (cuDNN has no per-chunk log-sum-exp to merge, so `cudnn` and `auto` take our
  kernels too) or for `pallas` in the interpreter; None: the jnp tiles (CPU, and TPU, whose
  splash kernel takes no external log-sum-exp in its backward)."""
  if impl in ("pallas", "cudnn") and platform == "gpu":
    return "gpu"
  if impl == "pallas" and interpret and platform != "tpu":
    return "gpu"
  return None


def attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT=None, *, impl="xla", causal=True,
              sm_scale=None, platform=None, interpret=False, block_q=None, block_k=None,
              context_parallel="all_gather", load_balance=True, window=None):
  """Causal (by default) attention within segments; returns [B, T, H, V] in q's dtype (V: the
  values' head dim, which may be smaller than the queries' E).

  `platform` is what the program compiles for ("cpu", "gpu", "tpu"; the model passes its
  mesh's); it resolves `auto` and picks the kernels' route. `interpret`, `block_q` and `block_k`
  apply to `pallas` only. Under a mesh whose `context` axis is > 1 the sequence is split over it
  (in the layout `load_balance` names) and `context_parallel` says how attention crosses the
  split (jaxtrain.parallel.context_attention: our Pallas kernels per chunk pair on GPU, exact jnp tiles
  elsewhere). `window`: a static sliding-window size (None: none; needs causal); not supported
  under context parallelism.
  """
  check_window(window, causal)
  platform = platform or current_platform()
  impl = resolve_impl(impl, platform, interpret=interpret, head_dim=q_BTHE.shape[-1])
  impl = impl_under_stages(impl, stage_count())
  e, ev = q_BTHE.shape[-1], v_BSKE.shape[-1]
  ek = kernel_head_dim(impl, platform, interpret, e)
  if (ev != e or ek != e) and (impl != "xla" or context_size() > 1):
    # Values with a head dim of their own (MLA: 128 against the queries' 192), or a head dim
    # the kernels do not take (the Triton kernels' powers of two: MLA's 192 runs as 256): the
    # kernels take one head dim, so queries, keys and values are zero-padded to it and the
    # output cut back. Exact: the padded dims add 0 to every score and their output columns
    # are 0; the softmax scale stays the unpadded head dim's.
    pad_qk, pad_v = [(0, 0)] * 3 + [(0, ek - e)], [(0, 0)] * 3 + [(0, ek - ev)]
    out_BTHE = attention(jnp.pad(q_BTHE, pad_qk), jnp.pad(k_BSKE, pad_qk),
                         jnp.pad(v_BSKE, pad_v), segment_ids_BT, impl=impl, causal=causal,
                         sm_scale=e ** -0.5 if sm_scale is None else sm_scale,
                         platform=platform, interpret=interpret, block_q=block_q,
                         block_k=block_k, context_parallel=context_parallel,
                         load_balance=load_balance, window=window)
    return out_BTHE[..., :ev]
  if context_size() > 1:
    if window is not None:
      raise ValueError(_CONTEXT_WINDOW_ERROR)
    return context_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, strategy=context_parallel,
                             balanced=load_balance, causal=causal, sm_scale=sm_scale,
                             kernel_platform=context_kernel_platform(impl, platform, interpret),
                             interpret=interpret, block_q=block_q, block_k=block_k)
  if impl == "pallas":
    return pallas_attention(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, causal=causal,
                            sm_scale=sm_scale, interpret=interpret, block_q=block_q,
                            block_k=block_k, platform=platform, window=window)
  fn = {"xla": xla_attention, "cudnn": cudnn_attention, "blockwise": blockwise_attention}[impl]
  return fn(q_BTHE, k_BSKE, v_BSKE, segment_ids_BT, causal=causal, sm_scale=sm_scale,
            window=window)
