"""Numerical building blocks that know nothing of models or training.

  attention.py            one attention signature, its implementations (xla, pallas, cudnn) and
                          the dispatch between them
  attention_tiles.py      exact attention over (query tile, key tile) pairs in plain jnp
  blockwise_attention.py  flash-style attention in plain jnp (memory linear in the length)
  cross_entropy.py        fused, chunked cross-entropy over a large vocabulary
  grouped_matmul.py       the experts' grouped matmul (rows sorted by group)
  fp8.py, mxfp8.py        FP8 matmuls with current scaling, and the MXFP8 block-scaled format
  quantize.py             int8 / int4 / nf4 weight storage with per-group scales (QLoRA's base)
  projection.py           one projection: (dequantized) base matmul plus an optional adapter
  weight_cast.py          weights into the compute dtype, a layer at a time

The Pallas kernels themselves live in the top-level `kernels_pallas` package.
"""
