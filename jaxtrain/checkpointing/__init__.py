"""Everything a run persists, and how it reads it back.

  checkpointer.py    Orbax checkpoints of a run: train state, data-iterator state, metadata
  iterator_state.py  the data iterator's state as an Orbax checkpoint item
  verdicts.py        what a failed restore means (corrupt, transient, fatal), agreed by all
  weights.py         params-only weights directories (`checkpoint.init_from`, export)
  mirror.py          checkpoints on an s3:// or gs:// bucket through a local staging directory
  run_directory.py   the run's other files (metrics.jsonl, TensorBoard) on a bucket workdir

The path layer these sit on (local paths and object-storage URLs) is `jaxtrain/storage.py`.
"""
