"""The data iterator's state in a checkpoint: an Orbax CheckpointHandler writing
`global_stream.json` for data read as one global stream, else one JSON file per data shard
(`shard_<s>-of-<S>.json`), and the one-line refusals when a checkpoint's data state does not fit
this run's data layout (jaxtrain/checkpointing/checkpointer.py saves it as the `data` item)."""

from __future__ import annotations

import dataclasses
import json
import re

import orbax.checkpoint as ocp

from jaxtrain.config import ConfigError
from jaxtrain.data.global_stream import GlobalBatchStream
from jaxtrain.data.shards import ShardedIterator

GLOBAL_STREAM_FILE = "global_stream.json"


class DataShardsHandler:
  """Orbax CheckpointHandler for a ShardedIterator: one JSON file per data shard.

  Reads checkpoints of grain's own handler too (`process_<p>-of-<P>.json`): process p of P
  there is shard p of P here.
  """

  def save(self, directory, item=None, args=None):
    it = item or args.item
    if isinstance(it, GlobalBatchStream):
      if it.saves_state:
        (directory / GLOBAL_STREAM_FILE).write_text(json.dumps(it.get_state(), indent=1))
      return
    for shard, state in it.shard_states().items():
      (directory / _shard_file(shard, it.num_shards)).write_text(json.dumps(state, indent=1))

  def restore(self, directory, item=None, args=None):
    it = item or args.item
    if isinstance(it, GlobalBatchStream):
      path = directory / GLOBAL_STREAM_FILE
      if not path.exists():
        raise ConfigError(_not_global_message(directory))
      it.set_state(json.loads(path.read_text()))
      return it
    states = {}
    for shard in it.shards:
      for name in (_shard_file(shard, it.num_shards), f"process_{shard}-of-{it.num_shards}.json"):
        if (directory / name).exists():
          states[shard] = json.loads((directory / name).read_text())
          break
      else:
        raise ConfigError(_missing_shard_message(directory, shard, it.num_shards))
    it.set_shard_states(states)
    it.start_prefetch()
    return it

  # The rest of Orbax's CheckpointHandler protocol: nothing to report or clean up.
  def structure(self, directory):
    del directory

  def metadata(self, directory):
    del directory

  def finalize(self, directory):
    del directory

  def close(self):
    pass

  @classmethod
  def typestr(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(DataShardsHandler, for_save=True)
@dataclasses.dataclass
class DataShardsSave(ocp.args.CheckpointArgs):
  item: ShardedIterator


@ocp.args.register_with_handler(DataShardsHandler, for_restore=True)
@dataclasses.dataclass
class DataShardsRestore(ocp.args.CheckpointArgs):
  item: ShardedIterator


def _not_global_message(directory) -> str:
  saved = sorted(p.name for p in directory.iterdir())
  return (f"checkpoint {directory.parent}: its data state ({', '.join(saved) or 'none'}) is "
          f"per data shard, from a run with data.num_shards > 0 or from an earlier jaxtrain, "
          f"and this run reads its data as one global stream (data.num_shards=0), so the data "
          f"cannot resume exactly; resume with the run's own --config.data.num_shards, or "
          f"start a new run from its weights with --config.checkpoint.init_from="
          f"{directory.parent}")


def _shard_file(shard: int, num_shards: int) -> str:
  return f"shard_{shard}-of-{num_shards}.json"


def _missing_shard_message(directory, shard: int, num_shards: int) -> str:
  saved = sorted({int(m.group(1)) for p in directory.iterdir()
                  if (m := re.fullmatch(r"(?:shard|process)_\d+-of-(\d+)\.json", p.name))})
  if not saved:
    if (directory / GLOBAL_STREAM_FILE).exists():
      return (f"checkpoint {directory.parent}: its data was read as one global stream "
              f"(data.num_shards=0), and this run reads {num_shards} data shards "
              f"(data.num_shards={num_shards}), so the data cannot resume exactly; resume "
              f"with --config.data.num_shards=0")
    return f"checkpoint {directory}: no data-iterator state for data shard {shard}"
  was = saved[0]
  return (f"checkpoint {directory.parent}: its data stream was saved as {was} data shards, "
          f"this run reads {num_shards} (data.num_shards, 0: one per process), so the data "
          f"cannot resume exactly; run with --config.data.num_shards={was} on a process count "
          f"that divides {was}")
