"""Inside shard_map every value carries the manual mesh axes it varies over. A custom_vjp's
backward must give each input's cotangent that input's type, so the custom matmuls (the FP8
ones, the blocked grouped matmul) mark their operands alike first (`vary_alike`)."""

from __future__ import annotations

import jax


def varying(x) -> frozenset:
  """The manual mesh axes `x` varies over inside shard_map (empty outside)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary_alike(*arrays):
  """`arrays` marked as varying over the union of their axes. A custom_vjp's backward must give
  each input's cotangent the input's type; marked first, the cotangents' sums over the axes an
  input did not vary over (a weight's gradient over the token shards) are JAX's to insert."""
  union = frozenset().union(*(varying(a) for a in arrays))
  return tuple(a if varying(a) == union else
               jax.lax.pcast(a, tuple(sorted(union - varying(a))), to="varying")
               for a in arrays)
