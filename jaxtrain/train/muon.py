"""Muon (`optim.name = "muon"`): orthogonalized momentum for the projection matrices.

For each projection matrix G (its gradient), Muon keeps one momentum buffer and updates with
the nearest semi-orthogonal matrix to the (Nesterov) momentum:

    m <- mu * m + G                     (optim.muon.momentum, mu = 0.95)
    U  = G + mu * m  (Nesterov)  or  m
    O  = NewtonSchulz5(U)               (optim.muon.ns_steps quintic iterations, U's polar factor)
    update = scale(A, B) * O            then decoupled weight decay and -lr, as AdamW's

`scale` is Moonlight's 0.2 * sqrt(max(A, B)) (`adjust_lr = "match_rms_adamw"`), which gives
the update AdamW's typical RMS so `optim.learning_rate` and `optim.weight_decay` carry over, or
the original sqrt(max(1, out / in)) (`"original"`). A and B are the matrix's input and output
sizes. Everything that is not a projection matrix (embeddings, the output head, norms, biases,
routers) gets AdamW with the existing settings (optim.py).

Which leaves are matrices, and how each reads as a stack of [in, out] matrices, comes from the
parameter's name: jaxtrain's weights end in shape letters (`wq_DHE`, `w_down_FD`,
`w_gate_XDF`, `wkv_b_RHB`). The letters name the trailing axes; leading axes beyond them are the
layer stack (scanned layers, [L, ...]), and `X` is the experts' axis: every layer's and every
expert's matrix is orthogonalized on its own. Of the remaining letters, a trailing `D` (the
model dim) is the output and the others the input (`wo_HED` -> [H*E, D]); otherwise the first
letter is the input and the others the output (`wq_DHE` -> [D, H*E]).

Sharding: Newton-Schulz on a matrix split over the mesh would need that matrix's every product
reduced across devices. Instead the stack of matrices is spread over the devices (each device
orthogonalizes whole matrices, N / devices of them: `_spread`), then resharded back to the
parameter's own layout, so no device holds more than its share of the stacked weight.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic Newton-Schulz of Keller Jordan's Muon
ADJUST_LR = ("match_rms_adamw", "original")
# Leaves that keep AdamW although their names end in shape letters: the token embedding, the
# output head (Muon's authors keep both on AdamW) and the MoE router.
_ADAMW_PREFIXES = ("embed", "head", "router")
_LETTERS = re.compile(r"_([A-Z]{2,})$")
_BATCH_LETTERS = ("X",)  # experts


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
  """How one parameter reads as a stack of [in, out] matrices: axes of the batch (layers,
  experts), of the matrix's input and of its output."""
  batch: tuple[int, ...]
  rows: tuple[int, ...]
  cols: tuple[int, ...]

  def sizes(self, shape) -> tuple[int, int, int]:
    size = lambda axes: math.prod(shape[a] for a in axes)
    return size(self.batch), size(self.rows), size(self.cols)


def _leaf_name(path) -> str:
  """The parameter's own name: the path's last key, past an nnx Variable's `.value`."""
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  while len(names) > 1 and names[-1] == "value":
    names.pop()
  return names[-1]


def matrix_layout(path, shape) -> MatrixLayout | None:
  """The leaf's matrix layout, or None where it gets AdamW."""
  name = _leaf_name(path)
  match = _LETTERS.search(name)
  if not match or name.startswith(_ADAMW_PREFIXES) or len(match.group(1)) > len(shape):
    return None
  letters = match.group(1)
  first = len(shape) - len(letters)
  batch = list(range(first))
  matrix = []
  for i, letter in enumerate(letters):
    (batch if letter in _BATCH_LETTERS else matrix).append(first + i)
  if len(matrix) < 2:
    return None
  if letters[matrix[-1] - first] == "D":
    rows, cols = matrix[:-1], matrix[-1:]
  else:
    rows, cols = matrix[:1], matrix[1:]
  return MatrixLayout(tuple(batch), tuple(rows), tuple(cols))


def layouts(params) -> Any:
  """Tree of MatrixLayout (Muon) or None (AdamW), one per leaf."""
  return jax.tree_util.tree_map_with_path(lambda p, x: matrix_layout(p, x.shape), params)


def labels(params) -> Any:
  """optax.multi_transform's labels: "muon" or "adamw" per leaf."""
  return jax.tree.map(lambda lay: "adamw" if lay is None else "muon", layouts(params),
                      is_leaf=lambda x: x is None or isinstance(x, MatrixLayout))


def describe(params) -> str:
  """The run table's row: which parameters train with Muon and which with AdamW (leaves,
  parameters, bytes in the parameters' dtype)."""
  totals = {"muon": [0, 0, 0], "adamw": [0, 0, 0]}
  for leaf, label in zip(jax.tree.leaves(params), jax.tree.leaves(labels(params))):
    total = totals[label]
    total[0] += 1
    total[1] += math.prod(leaf.shape)
    total[2] += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
  part = lambda name, n, count, size: (f"{name} {n} tensors, {count:,} params "
                                       f"({size / 2**20:,.1f} MiB)")
  return "; ".join(part(k, *v) for k, v in totals.items())


def newton_schulz(u_NAB: jax.Array, steps: int, eps: float = 1e-7) -> jax.Array:
  """The polar factor's quintic Newton-Schulz approximation, per matrix, in float32.

  Normalized by the Frobenius norm (so every singular value is <= 1), iterated on the wide
  orientation (A <= B: the Gram matrix is the smaller A x A)."""
  x = u_NAB.astype(jnp.float32)
  tall = x.shape[-2] > x.shape[-1]
  if tall:
    x = jnp.swapaxes(x, -1, -2)
  x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
  a, b, c = NS_COEFFS
  for _ in range(steps):
    gram = x @ jnp.swapaxes(x, -1, -2)
    x = a * x + (b * gram + c * gram @ gram) @ x
  return jnp.swapaxes(x, -1, -2) if tall else x


def update_scale(rows: int, cols: int, adjust_lr: str) -> float:
  if adjust_lr == "match_rms_adamw":
    return 0.2 * math.sqrt(max(rows, cols))
  return math.sqrt(max(1.0, cols / rows))


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
  """Multiply-adds x 2 of one matrix's orthogonalization (not model FLOPs)."""
  a, b = min(rows, cols), max(rows, cols)
  return steps * (4 * a * a * b + 2 * a ** 3)


def _spread(x_NAB: jax.Array) -> jax.Array:
  """Constrains the stack's matrix axis over as many of the mesh's axes as divide it, each
  matrix whole on one device (a no-op outside a mesh or for a single matrix)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or x_NAB.shape[0] == 1:
    return x_NAB
  axes, size = [], 1
  for name, n in zip(mesh.axis_names, mesh.axis_sizes):
    if n > 1 and x_NAB.shape[0] % (size * n) == 0:
      axes.append(name)
      size *= n
  if not axes:
    return x_NAB
  spec = jax.sharding.PartitionSpec(tuple(axes), None, None)
  return jax.lax.with_sharding_constraint(x_NAB, spec)


def orthogonalize(u: jax.Array, layout: MatrixLayout, steps: int, adjust_lr: str) -> jax.Array:
  """scale * NewtonSchulz(u) for every matrix of the stack, in u's shape and dtype."""
  order = layout.batch + layout.rows + layout.cols
  n, rows, cols = layout.sizes(u.shape)
  moved = jnp.transpose(u, order)
  o_NAB = newton_schulz(_spread(moved.reshape(n, rows, cols)), steps)
  o = o_NAB.reshape(moved.shape) * update_scale(rows, cols, adjust_lr)
  return jnp.transpose(o, tuple(order.index(i) for i in range(u.ndim))).astype(u.dtype)


class ScaleByMuonState(NamedTuple):
  momentum: Any


def scale_by_muon(momentum: float, ns_steps: int, adjust_lr: str, nesterov: bool = True,
                  state_dtype: Any = jnp.float32) -> optax.GradientTransformation:
  """Muon's update direction (before weight decay and learning rate) for a tree of matrices
  named as jaxtrain names its weights (`matrix_layout`); the momentum is kept in
  `state_dtype`, computed in float32."""
  state_dtype = jnp.dtype(state_dtype)

  def init(params):
    return ScaleByMuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, state_dtype), params))

  def update(grads, state, params=None):
    del params
    def one(path, g, m):
      layout = matrix_layout(path, g.shape)
      g32 = g.astype(jnp.float32)
      m32 = momentum * m.astype(jnp.float32) + g32
      u = g32 + momentum * m32 if nesterov else m32
      return orthogonalize(u, layout, ns_steps, adjust_lr).astype(g.dtype), m32.astype(state_dtype)
    out = jax.tree_util.tree_map_with_path(one, grads, state.momentum)
    # (an optax.MaskedNode, a leaf multi_transform gave the other optimizer, is a tuple too)
    is_out = lambda x: isinstance(x, tuple) and not isinstance(x, optax.MaskedNode)
    pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=is_out)
    return pick(0), ScaleByMuonState(pick(1))

  return optax.GradientTransformation(init, update)
