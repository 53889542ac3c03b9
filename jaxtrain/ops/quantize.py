"""Frozen base weights stored in 8 or 4 bits with per-group scales (QLoRA), our own format.

A projection weight w [*in, *out] (shape letters: I = prod(in), the contraction size; O its
output dims; G = I / group groups) is stored as
  codes  [I, *O] int8           (int8), or [I/2, *O] uint8, two 4-bit codes per byte (int4, nf4)
  scales [G, *O] float32        one absmax scale per `group` consecutive input elements
and dequantized as  w[i, o] = level(code[i, o]) * scales[i // group, o].

- Groups run along the input dim, so one scale covers the elements a matmul output sums over,
  and a stacked [L, ...] weight is quantized layer by layer (scan sees one layer at a time).
- 4-bit codes are packed along the input dim (element 2i in the low nibble, 2i+1 in the high),
  which keeps every other dim, and so its logical axis and sharding, as the weight has it. The
  flattened input dim carries the name of the weight's outermost input axis (`embed`, `mlp`, or
  `heads` for the o projection's [H, E] input): a mesh axis that splits it must split the
  groups evenly (see `mesh_errors`).
- Scales are float32: 4 bytes per 64 weights is 0.5 bit/param (0.56 byte/param in all for
  4-bit); bfloat16 would save 0.25 bit/param but its 8-bit mantissa rounds each scale by up to
  0.4%, the size of int8's own rounding step.

Schemes (all symmetric, absmax per group; a group of zeros gets scale 0 and codes for 0):
  int8: round(w / s) in -127..127, s = absmax / 127.
  int4: round(w / s) in -7..7 (15 levels), s = absmax / 7; stored as code + 8 in 1..15.
  nf4: the nearest of the 16 NormalFloat levels (QLoRA, Dettmers et al. 2023: quantiles of
    N(0, 1) scaled to [-1, 1], with an exact 0) of w / s, s = absmax.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.parallel.mesh import shard

SCHEMES = ("int8", "int4", "nf4")
BITS = {"int8": 8, "int4": 4, "nf4": 4}
_INT_MAX = {"int8": 127, "int4": 7}

# NF4: 8 positive and 7 negative normal quantiles, normalized to [-1, 1], plus 0 (the QLoRA
# paper's table; tests/test_peft.py rebuilds it from the normal quantile function).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
# Decision boundaries between neighbouring levels: the nearest level is the count below.
_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2

# FSDP shards weights along `embed` and gathers them whole for the matmul (GSPMD inserts the
# all-gather). Constraining the codes (and scales) to be whole along `embed` first makes that
# gather move 4-bit/8-bit codes rather than the dequantized weight: 4-8x fewer bytes.
_GATHERED = ("embed", "expert_embed")


class Quantized(nnx.Variable):
  """Codes or scales of a quantized frozen weight: neither nnx.Param nor an adapter, so no
  optimizer or gradient filter ever selects it."""


def check_group(shape, num_in: int, scheme: str, group_size: int, where: str = "weight"):
  """Raises ValueError unless `group_size` splits the input dims of `shape` for `scheme`."""
  if scheme not in SCHEMES:
    raise ValueError(f"{where}: quantization scheme {scheme!r} unknown; choose one of "
                     f"{', '.join(SCHEMES)}")
  if not 1 <= num_in < len(shape):
    raise ValueError(f"{where}: shape {tuple(shape)} with {num_in} input dims leaves no "
                     f"output dim; a projection weight is [*in, *out]")
  in_size = math.prod(shape[:num_in])
  if group_size <= 0 or (BITS[scheme] == 4 and group_size % 2):
    why = " (two 4-bit codes share a byte)" if BITS[scheme] == 4 else ""
    raise ValueError(f"{where}: quant_group_size={group_size} must be a positive "
                     f"{'even ' if why else ''}number{why}; typical: 64")
  if in_size % group_size:
    divisors = [g for g in (128, 64, 32, 16, 8) if in_size % g == 0]
    raise ValueError(f"{where}: shape {tuple(shape)} has {in_size} input elements per output, "
                     f"not a multiple of quant_group_size={group_size}; use a group size "
                     f"dividing {in_size}{' (e.g. ' + str(divisors[0]) + ')' if divisors else ''}")


def quantize(w: jax.Array, scheme: str, group_size: int, num_in: int = 1):
  """w [*in, *out] -> (codes, scales float32 [G, *out]); see the module docstring."""
  check_group(w.shape, num_in, scheme, group_size)
  in_size, out = math.prod(w.shape[:num_in]), w.shape[num_in:]
  w_GgO = w.astype(jnp.float32).reshape(in_size // group_size, group_size, *out)
  absmax_G1O = jnp.max(jnp.abs(w_GgO), axis=1, keepdims=True)
  scale_G1O = absmax_G1O / _INT_MAX.get(scheme, 1.0)
  # An all-zero group: any scale decodes to 0; divide by 1 instead of 0.
  y_GgO = w_GgO / jnp.where(scale_G1O > 0, scale_G1O, 1.0)
  if scheme == "nf4":
    # Binary search (the default "scan" method): no [.., 15] comparison tensor per weight.
    codes = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), y_GgO).astype(jnp.uint8)
  else:
    top = _INT_MAX[scheme]
    q = jnp.clip(jnp.round(y_GgO), -top, top)
    codes = q.astype(jnp.int8) if scheme == "int8" else (q + 8).astype(jnp.uint8)
  codes_IO = codes.reshape(in_size, *out)
  if BITS[scheme] == 4:
    codes_IO = pack_nibbles(codes_IO)
  return codes_IO, scale_G1O.reshape(in_size // group_size, *out)


def dequantize(codes: jax.Array, scales: jax.Array, scheme: str, shape, dtype) -> jax.Array:
  """(codes, scales) of one weight -> the weight [*shape] (its unquantized shape) in `dtype`."""
  num_out = codes.ndim - 1
  in_size, out = math.prod(shape[:len(shape) - num_out]), tuple(shape[len(shape) - num_out:])
  groups = scales.shape[0]
  if BITS[scheme] == 4:
    nibbles_IO = unpack_nibbles(codes)
    if scheme == "nf4":
      values_IO = jnp.asarray(NF4_LEVELS)[nibbles_IO]
    else:
      values_IO = nibbles_IO.astype(jnp.float32) - 8.0
  else:
    values_IO = codes.astype(jnp.float32)
  if values_IO.shape != (in_size, *out) or scales.shape != (groups, *out) or in_size % groups:
    raise ValueError(f"codes {codes.shape} / scales {scales.shape} ({scheme}) do not describe a "
                     f"weight of shape {tuple(shape)}")
  w_GgO = values_IO.reshape(groups, in_size // groups, *out) * scales[:, None]
  return w_GgO.reshape(shape).astype(dtype)


def pack_nibbles(codes_IO: jax.Array) -> jax.Array:
  """[I, ...] uint8 codes in 0..15 -> [I/2, ...] bytes: element 2i low nibble, 2i+1 high."""
  if codes_IO.shape[0] % 2:
    raise ValueError(f"pack_nibbles: the packed dim has odd size {codes_IO.shape[0]}; 4-bit "
                     f"codes pack in pairs along it")
  pairs = codes_IO.astype(jnp.uint8).reshape(codes_IO.shape[0] // 2, 2, *codes_IO.shape[1:])
  return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """Inverse of pack_nibbles: [I/2, ...] bytes -> [I, ...] uint8 codes in 0..15."""
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=1)
  return pairs.reshape(2 * packed.shape[0], *packed.shape[1:])


def _over_leading(fn, num_lead: int):
  """fn applied to arrays with `num_lead` extra leading dims (stacked layers), one slice at a
  time (lax.map, not vmap): only one layer's float32 intermediates live at once."""
  for _ in range(num_lead):
    fn = (lambda f: lambda *xs: jax.lax.map(lambda args: f(*args), xs))(fn)
  return fn


class QuantizedWeight(nnx.Module):
  """Storage of one frozen projection weight; takes the weight's place in the module tree.

  codes/scales carry the weight's logical axes (the flattened input dim named after its
  outermost input axis), so under `nnx.vmap` over layers they stack to [L, ...] with `layers`
  in front, like the Param they replace. `in_axis`: where a single input dim sits in the
  weight when it is not first (an MoE layer's experts [X, D, F]: D); the storage puts it first
  ([D, X, F]: groups run along D within each expert) and dequantizing puts it back.
  """

  def __init__(self, w: jax.Array, names, scheme: str, group_size: int, num_in: int = 1,
               in_axis: int = 0):
    if in_axis and num_in != 1:
      raise ValueError(f"QuantizedWeight: in_axis={in_axis} needs a single input dim")
    order = (in_axis, *(i for i in range(w.ndim) if i != in_axis))
    stored_names = tuple(names[i] for i in order)
    codes, scales = quantize(jnp.transpose(w, order) if in_axis else w, scheme, group_size,
                             num_in)
    storage_names = (stored_names[0], *stored_names[num_in:])
    self.codes = Quantized(codes, out_sharding=storage_names)
    self.scales = Quantized(scales, out_sharding=storage_names)
    self.scheme = scheme
    self.shape = tuple(w.shape)  # of one layer's weight, unquantized
    self.stored_shape = tuple(w.shape[i] for i in order)
    self.num_in = num_in
    self.in_axis = in_axis
    self.storage_names = storage_names

  @property
  def in_size(self) -> int:
    """Input elements per output (what the quantization groups split)."""
    return math.prod(self.stored_shape[:self.num_in])

  def _num_lead(self, ndim: int) -> int:
    return ndim - (len(self.shape) - self.num_in + 1)

  def dequantize(self, dtype) -> jax.Array:
    """The weight [*lead, *shape] in `dtype`; lead = stacked layer dims, if any."""
    codes, scales = self.codes[...], self.scales[...]
    num_lead = self._num_lead(codes.ndim)
    if num_lead == 0:
      gathered = tuple(None if n in _GATHERED else n for n in self.storage_names)
      codes, scales = shard(codes, gathered), shard(scales, gathered)
    fn = lambda c, s: dequantize(c, s, self.scheme, self.stored_shape, dtype)  # noqa: E731
    w = _over_leading(fn, num_lead)(codes, scales)
    return jnp.moveaxis(w, num_lead, num_lead + self.in_axis) if self.in_axis else w

  def num_params(self) -> int:
    """Weights stored here (all layers when stacked)."""
    num_lead = self._num_lead(self.codes.ndim)
    return math.prod(self.codes.shape[:num_lead]) * math.prod(self.shape)

  def quantize_from(self, w: jax.Array):
    """Stores w [*lead, *shape] (e.g. a base checkpoint's stacked weight) in place."""
    num_lead = w.ndim - len(self.shape)
    if num_lead < 0 or tuple(w.shape[num_lead:]) != self.shape:
      raise ValueError(f"weight of shape {tuple(w.shape)} cannot fill quantized storage of a "
                       f"{self.shape} weight")
    if self.in_axis:
      w = jnp.moveaxis(w, num_lead + self.in_axis, num_lead)
    group_size = self.in_size // self.scales.shape[num_lead]
    fn = lambda x: quantize(x, self.scheme, group_size, self.num_in)  # noqa: E731
    codes, scales = _over_leading(fn, num_lead)(w)
    self.codes.set_value(codes)
    self.scales.set_value(scales)
