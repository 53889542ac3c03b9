"""Training: the pure step, everything derived before it, and the loop around it.

  step.py              the pure train and eval steps and their sharded jit (no I/O)
  setup.py             model, optimizer and state shardings derived from a config and a mesh
  optim.py             the optimizer from config: AdamW, warmup + cosine, clipping
  loop.py              run(): sharded init, the training loop, eval, checkpoints, metrics
  measure.py           ahead-of-time compile of the real step: memory and FLOPs per device
  memory_breakdown.py  where a compiled step's memory goes (the buffers live at its peak)
  hlo_flops.py         matmul FLOPs of a compiled XLA program
  hlo_collectives.py   bytes its collectives move per run, by kind (the same parser)
  preflight.py         before the first weight is allocated: will the step fit?
  metrics.py           parameter and FLOP accounting, MFU, and the metric writers
  wandb.py             the Weights & Biases side of the metric writer
  health.py            non-finite steps that stop a run, loss spikes that are reported
"""
