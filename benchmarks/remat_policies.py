"""Memory and compute of every remat policy, measured with the dry run's compile.

`python benchmarks/remat_policies.py [--config=configs/llama8b.py] [--devices=8] [--accum=32]
[--attention=xla]`
compiles the train step of the config for each `model.remat_policy` on emulated CPU devices,
modelling a GPU as `--dry_run_devices` does (jaxtrain/train/measure.py), and prints one
markdown table: per-device temporaries and total device memory, activations held in host memory
by the offload policies, and FLOPs per step from the compiled program against the analytic 6·N
formula. The default `--accum=32` makes llama8b's per-device microbatch one sequence of 8192
tokens on 8 devices. Last line:

  remat_policies: <policy>=<temp GiB>/<FLOPs ratio> ...
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxtrain.config import REMAT_POLICIES, load_config_file  # noqa: E402
from jaxtrain.hardware import GIB  # noqa: E402
from jaxtrain.train import measure as aot  # noqa: E402  (after the path, before any backend)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/llama8b.py")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--accum", type=int, default=32, help="train.grad_accum_steps")
  parser.add_argument("--attention", default=None,
                      help="attention.impl (default: the config's; 'xla' materializes scores)")
  args = parser.parse_args()
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.devices)

  config = load_config_file(args.config)
  config.train.grad_accum_steps = args.accum
  if args.attention:
    config.attention.impl = args.attention
  analytic = aot.analytic_flops_per_step(config)
  print(f"{args.config}: {args.devices} emulated CPU devices, global batch "
        f"{config.train.global_batch_size} × {config.train.seq_len}, grad accum {args.accum}, "
        f"attention.impl={config.attention.impl}")
  print()
  print("| remat policy | temporaries GiB | device total GiB | host GiB | FLOPs/step | "
        "FLOPs / analytic | compile s |")
  print("|---|---|---|---|---|---|---|")
  summary = []
  for policy in REMAT_POLICIES:
    config.model.remat_policy = policy
    # CPU devices modelling a GPU: bfloat16 compute, fused attention by its blockwise stand-in.
    m = aot.measure(config, jax.devices()[:args.devices], platform="gpu")
    flops = m.flops * m.num_devices
    print(f"| {policy} | {m.temp / GIB:.2f} | {m.total / GIB:.2f} | {m.act_host / GIB:.2f} | "
          f"{flops:.3e} | {flops / analytic:.3f} | {m.compile_s:.1f} |", flush=True)
    summary.append(f"{policy}={m.temp / GIB:.2f}/{flops / analytic:.3f}")
  print()
  print(f"analytic FLOPs per step: {analytic:.3e}")
  print("remat_policies: " + " ".join(summary))


if __name__ == "__main__":
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()  # CPU only where there is no accelerator
  main()
