"""The validation passes over a run config, run before anything compiles or allocates.

  checks.py      the one pass `validate(config)`: mesh shape, attention, family, pipeline and
                 context parallelism, precision, logging; the mesh shape it resolves
  finetuning.py  train.objective and its settings group, lora.*
  moe.py         the Mixture-of-Experts, latent-attention and multi-token-prediction settings
  multihost.py   host groups (mesh.dcn_*), data shards against processes, distributed.*
  storage.py     the run's object-storage paths

They sit above the objectives and models because they ask them (rows per step, a family's
switches); the defaults and allowed values they check against are in `jaxtrain/config.py`.
"""
