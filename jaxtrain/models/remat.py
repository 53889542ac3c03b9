"""Named remat policies (config.REMAT_POLICIES): what each layer keeps for the backward pass."""

from __future__ import annotations

import jax

QKV_NAMES = ("query_proj", "key_proj", "value_proj")
# Every weight projection's output, named with checkpoint_name: what `minimal` saves, by name.
PROJ_NAMES = QKV_NAMES + ("out_proj", "mlp_gate", "mlp_up", "mlp_down")
# Where offload policies move saved activations: from accelerator memory to page-locked host
# memory, which the device reads back over PCIe / the host link in the backward pass.
_SRC, _DST = "device", "pinned_host"
_TO_HOST = dict(offload_src=_SRC, offload_dst=_DST)


def _offload_all_dots(prim, *_, **__):
  """save_dots with every saved matmul output moved to host memory instead of kept on device."""
  if prim is jax.lax.dot_general_p:
    return jax.ad_checkpoint.Offloadable(src=_SRC, dst=_DST)
  return jax.ad_checkpoint.Recompute


def remat_policy(name: str, *, by_name: bool = False):
  """Named remat policies (config.REMAT_POLICIES). Returns None for `none` (no remat at all).

  full: save only each layer's input; recompute the whole layer in the backward pass.
  minimal: save the outputs of matmuls without dot_general batch dims, i.e. the weight
    projections (q/k/v/o, gate/up/down); recompute attention scores and elementwise work.
  save_dots: save every matmul output (most memory of the remat policies, least recompute).
  save_qkv_proj: save only the q/k/v projections (named with checkpoint_name), recompute the rest.
  *_offload: the same values saved, but in pinned host memory rather than device memory; the
    backward pass copies them back. Device memory of `full`, recompute of the base policy, plus
    host-link traffic (which XLA overlaps with compute where it can).

  `by_name`: the same choices made by the values' checkpoint names rather than by matmul shapes,
  for layers run under a vmap (pipeline stages), where every matmul gains a batch dim and a
  shape-based `minimal` would save nothing. There `save_dots` saves the projections too (the
  attention matmuls it adds have no names; flash kernels have none to save either way).
  """
  policies = jax.checkpoint_policies
  if by_name and name in ("minimal", "save_dots", "minimal_offload", "save_dots_offload"):
    if name.endswith("_offload"):
      return policies.save_and_offload_only_these_names(
          names_which_can_be_saved=(), names_which_can_be_offloaded=PROJ_NAMES, **_TO_HOST)
    return policies.save_only_these_names(*PROJ_NAMES)
  return {
      "none": None,
      "full": policies.nothing_saveable,
      "minimal": policies.dots_with_no_batch_dims_saveable,
      "save_dots": policies.dots_saveable,
      "save_qkv_proj": policies.save_only_these_names(*QKV_NAMES),
      "minimal_offload": policies.offload_dot_with_no_batch_dims(**_TO_HOST),
      "save_dots_offload": _offload_all_dots,
      "save_qkv_proj_offload": policies.save_and_offload_only_these_names(
          names_which_can_be_saved=(), names_which_can_be_offloaded=QKV_NAMES, **_TO_HOST),
  }[name]
