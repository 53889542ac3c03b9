"""Shared by the Mixture-of-Experts tests (test_moe*.py, test_deepseek.py); with_changes also by
test_targets.py."""

from jaxtrain.config import load_config_file


def on_short_rows(path: str, **mesh):
  """The config file at `path` on rows of 64 tokens, 8 per step (the same experts, routing and
  losses, faster steps), on the mesh axes given (the others 1)."""
  c = load_config_file(path)
  c.train.seq_len, c.train.global_batch_size, c.train.loss_chunk_size = 64, 8, 64
  c.model.max_position_embeddings = 64
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  for axis, size in mesh.items():
    setattr(c.mesh, axis, size)
  return c


def with_changes(config, changes: dict):
  """`config` with {"group.key": value} set (dotted for nested groups: "model.rope_scaling.type")."""
  for key, value in changes.items():
    *groups, name = key.split(".")
    group = config
    for g in groups:
      group = group[g]
    setattr(group, name, value)
  return config
