"""Pallas kernels owned by jaxtrain; each ships with a pure-jnp reference and an interpret flag."""

from kernels_pallas.flash_attention import flash_attention
from kernels_pallas.reference import reference_attention

__all__ = ["flash_attention", "reference_attention"]
