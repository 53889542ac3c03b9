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
reduced across devices. Instead each device trades its pieces of many matrices for whole
matrices of its share of the stack (an all_to_all per mesh axis that splits a matrix dim),
orthogonalizes those and trades them back (`orthogonalize`), so no device holds more than its
share of the stacked weight. (XLA's partitioner, asked for the same move by a sharding
constraint, replicated the stack first: 315 GiB per device for Kimi K2's experts.)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.config import MUON_ADJUST_LR

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic Newton-Schulz of Keller Jordan's Muon
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


def step_flops(params, ns_steps: int) -> float:
  """FLOPs of one step's orthogonalizations over the whole model (every matrix once; the padding
  of a stack to the devices not counted). Not model FLOPs: MFU leaves them out."""
  total = 0.0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    layout = matrix_layout(path, leaf.shape)
    if layout is not None:
      n, rows, cols = layout.sizes(leaf.shape)
      total += n * newton_schulz_flops(rows, cols, ns_steps)
  return total


def newton_schulz(u_NAB: jax.Array, steps: int, matmul_dtype: Any = jnp.float32,
                  eps: float = 1e-7) -> jax.Array:
  """The polar factor's quintic Newton-Schulz approximation, per matrix, in float32 with the
  products' operands in `matmul_dtype` (the model's compute dtype: bfloat16 on accelerators,
  as Muon's authors run it; float32 on CPU).

  Normalized by the Frobenius norm (so every singular value is <= 1), iterated on the wide
  orientation (A <= B: the Gram matrix is the smaller A x A). The iterations are a fori_loop:
  one iteration's buffers live at a time, and jax 0.10.2's XLA:GPU could not tile the unrolled
  form's Gram products of a 7168-wide matrix in a Triton GEMM fusion (kimi_k2_1t)."""
  x = u_NAB.astype(jnp.float32)
  tall = x.shape[-2] > x.shape[-1]
  if tall:
    x = jnp.swapaxes(x, -1, -2)
  x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
  mm = lambda p, q: jnp.matmul(p.astype(matmul_dtype), q.astype(matmul_dtype),
                               preferred_element_type=jnp.float32)
  a, b, c = NS_COEFFS
  def body(_, x):
    gram = mm(x, jnp.swapaxes(x, -1, -2))
    return a * x + mm(b * gram + c * mm(gram, gram), x)
  x = jax.lax.fori_loop(0, steps, body, x)
  return jnp.swapaxes(x, -1, -2) if tall else x


def update_scale(rows: int, cols: int, adjust_lr: str) -> float:
  """The orthogonalized update's factor for a rows x cols matrix, by optim.muon.adjust_lr."""
  match_rms, original = MUON_ADJUST_LR
  if adjust_lr == match_rms:
    return 0.2 * math.sqrt(max(rows, cols))
  assert adjust_lr == original, adjust_lr
  return math.sqrt(max(1.0, cols / rows))


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
  """Multiply-adds x 2 of one matrix's orthogonalization (not model FLOPs)."""
  a, b = min(rows, cols), max(rows, cols)
  return steps * (4 * a * a * b + 2 * a ** 3)


def _mesh_axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry's mesh axes, major first."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def orthogonalize(u: jax.Array, layout: MatrixLayout, steps: int, adjust_lr: str,
                  sharding: jax.sharding.NamedSharding | None = None) -> jax.Array:
  """scale * NewtonSchulz(u) for every matrix of the stack, in u's shape and dtype.

  With the parameter's `sharding`, where it splits a matrix's own dims over mesh axes, the
  orthogonalization runs in shard_map: each device's block is exchanged, axis by axis, for whole
  matrices (all_to_all: a matrix dim's pieces gathered, the stack split in as many parts; the
  stack zero-padded to divide), orthogonalized there and sent back the same way. A device
  holds its own share of the stack throughout, never the whole weight."""
  scale = update_scale(*layout.sizes(u.shape)[1:], adjust_lr)
  spec = tuple(sharding.spec) + (None,) * (u.ndim - len(sharding.spec)) if sharding else ()
  # (matrix dim, mesh axis) pairs to undo, minor axis first so a dim's pieces land in order.
  split = [(dim, axis) for dim in layout.rows + layout.cols if spec
           for axis in reversed(_mesh_axes(spec[dim]))
           if sharding.mesh.shape[axis] > 1]
  order = layout.batch + layout.rows + layout.cols
  inverse = tuple(order.index(i) for i in range(u.ndim))
  nb = len(layout.batch)

  def local(x):
    moved = jnp.transpose(x, order)
    batch = moved.shape[:nb]
    x_N = moved.reshape(math.prod(batch), *moved.shape[nb:])
    n = x_N.shape[0]
    parts = math.prod(sharding.mesh.shape[a] for _, a in split) if split else 1
    x_N = jnp.pad(x_N, [(0, -n % parts)] + [(0, 0)] * (x_N.ndim - 1))
    for dim, axis in split:  # 1 + the dim's place among the matrix dims
      x_N = jax.lax.all_to_all(x_N, axis, 0, 1 + order.index(dim) - nb, tiled=True)
    matrix = x_N.shape[1:]
    rows = math.prod(matrix[:len(layout.rows)])
    o_N = newton_schulz(x_N.reshape(-1, rows, math.prod(matrix) // rows), steps)
    o_N = o_N.reshape(x_N.shape) * scale
    for dim, axis in reversed(split):
      o_N = jax.lax.all_to_all(o_N, axis, 1 + order.index(dim) - nb, 0, tiled=True)
    o = o_N[:n].reshape(moved.shape)
    return jnp.transpose(o, inverse).astype(x.dtype)

  if not split:
    return local(u)
  partition = jax.sharding.PartitionSpec(*spec)
  return jax.shard_map(local, mesh=sharding.mesh, in_specs=partition, out_specs=partition,
                       check_vma=False)(u)


class ScaleByMuonState(NamedTuple):
  momentum: Any


def scale_by_muon(momentum: float, ns_steps: int, adjust_lr: str, nesterov: bool = True,
                  state_dtype: Any = jnp.float32,
                  param_shardings: Any = None) -> optax.GradientTransformation:
  """Muon's update direction (before weight decay and learning rate) for a tree of matrices
  named as jaxtrain names its weights (`matrix_layout`); the momentum is kept in
  `state_dtype`, computed in float32. `param_shardings` (the params' NamedShardings): the
  orthogonalization then exchanges shards for whole matrices (`orthogonalize`)."""
  state_dtype = jnp.dtype(state_dtype)
  by_path = {} if param_shardings is None else {
      jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(param_shardings)}

  def init(params):
    return ScaleByMuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, state_dtype), params))

  def update(grads, state, params=None):
    del params
    def one(path, g, m):
      layout = matrix_layout(path, g.shape)
      g32 = g.astype(jnp.float32)
      m32 = momentum * m.astype(jnp.float32) + g32
      u = g32 + momentum * m32 if nesterov else m32
      o = orthogonalize(u, layout, ns_steps, adjust_lr, by_path.get(jax.tree_util.keystr(path)))
      return o.astype(g.dtype), m32.astype(state_dtype)
    out = jax.tree_util.tree_map_with_path(one, grads, state.momentum)
    # (an optax.MaskedNode, a leaf multi_transform gave the other optimizer, is a tuple too)
    is_out = lambda x: isinstance(x, tuple) and not isinstance(x, optax.MaskedNode)
    pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=is_out)
    return pick(0), ScaleByMuonState(pick(1))

  return optax.GradientTransformation(init, update)
