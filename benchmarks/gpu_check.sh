#!/usr/bin/env bash
# Every GPU check in one script, under 10 minutes on one H100 / H200 (the RL runs last: a cut-short
# run keeps everything before them):
#   1. the Pallas flash-attention kernels compiled for the GPU against the float32 reference
#      (output and dq/dk/dv, bf16 inputs), and the compiled kernel tests;
#   2. benchmarks/attention.py: pallas vs cudnn vs xla forward+backward at T = 2048/4096/8192;
#   3. a short bf16 training run of Llama 3.2 1B with each GPU attention implementation, and
#      one with its projections in FP8 (precision.matmul=fp8), reporting tokens/s and MFU from
#      metrics.jsonl (each run passes the pre-flight check first; FP8's MFU is against the FP8
#      peak);
#   4. the dry run's deviceless compile for this GPU's target (h200x1 / h100x1) against the same
#      step compiled on the GPU itself: per-device GiB of each and their ratio;
#   5. RL: GRPO's logprob_mismatch (sampler against trainer) on the GPU in bfloat16, for an
#      8-expert grpo_tiny without and with routing replay (grpo.replay_routing).
# Needs a Python with jaxtrain[cuda12] installed (PYTHON, default .venv/bin/python).
# Usage: benchmarks/gpu_check.sh [OUTPUT_DIR]   (logs and run directories go there)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT_DIR"

"$PY" - <<'PY'
import jax, sys
if jax.default_backend() != "gpu":
  sys.exit(f"gpu_check.sh needs a GPU backend; JAX sees {jax.default_backend()!r}. "
           "Install with: pip install -e '.[cuda12]'")
print("devices:", [d.device_kind for d in jax.devices()])
PY

echo "== 1/5 kernel parity on the GPU"
timeout 150 "$PY" benchmarks/attention.py --check 2>&1 | tee "$OUT_DIR/parity.log"
JAX_PLATFORMS=cuda JAXTRAIN_PALLAS_COMPILED=1 timeout 150 "$PY" -m pytest -q -x tests/test_flash_attention.py \
  2>&1 | tail -5 | tee -a "$OUT_DIR/parity.log"

echo "== 2/5 attention benchmark (bf16, causal, E=128)"
timeout 150 "$PY" benchmarks/attention.py --iters 10 2>&1 | tee "$OUT_DIR/attention.log"

echo "== 3/5 Llama 3.2 1B, bf16, 20 steps per attention implementation; then FP8 matmuls"
for run in pallas:none cudnn:none cudnn:fp8; do
  impl=${run%%:*} matmul=${run##*:}
  [[ $matmul == none ]] || impl="$impl-$matmul"
  timeout 100 "$PY" -m jaxtrain.main --config=configs/llama3_1b.py \
    --workdir="$OUT_DIR/llama3_1b_$impl" --config.attention.impl=${run%%:*} \
    --config.precision.matmul=$matmul \
    --config.train.steps=20 --config.train.global_batch_size=8 --config.train.seq_len=2048 \
    --config.train.log_every=5 --config.train.eval_every=1000 --config.log.tensorboard=False \
    2>&1 | tail -4 | tee "$OUT_DIR/train_$impl.log"
  "$PY" - "$OUT_DIR/llama3_1b_$impl/metrics.jsonl" "$impl" <<'PY'
import json, sys
records = [json.loads(l) for l in open(sys.argv[1]) if '"mfu"' in l]
last = [r for r in records if r.get("mfu")][-2:]  # the first interval includes warm-up
print(f"train_1b: impl={sys.argv[2]} tokens_per_sec={sum(r['tokens_per_sec'] for r in last) / len(last):.0f} "
      f"mfu={sum(r['mfu'] for r in last) / len(last):.3f}")
PY
done

echo "== 4/5 deviceless compile for the target vs the same step compiled on this GPU"
timeout 150 "$PY" - <<'PY' 2>&1 | tee "$OUT_DIR/dry_run_vs_device.log"
import jax
from jaxtrain.config import load_config_file
from jaxtrain.dryrun import measure, targets
kind = jax.devices()[0].device_kind.lower()
name = "h200x1" if "h200" in kind else "h100x1"
config = load_config_file("configs/llama3_1b.py")
config.target, config.attention.impl = name, "cudnn"
config.train.global_batch_size, config.train.seq_len, config.train.grad_accum_steps = 4, 4096, 1
on_device = measure.measure(config, jax.devices()[:1])
deviceless = measure.measure(config, targets.devices(targets.parse(name)))
gib = 2 ** 30
print(f"dry_run_vs_device: target={name} device_kind={jax.devices()[0].device_kind!r} "
      f"deviceless_total_gib={deviceless.total / gib:.3f} device_total_gib={on_device.total / gib:.3f} "
      f"ratio={deviceless.total / on_device.total:.3f}")
PY

echo "== 5/5 GRPO logprob_mismatch in bfloat16, MoE policy, without and with routing replay"
for replay in False True; do
  timeout 75 "$PY" -m jaxtrain.main --config=configs/grpo_tiny.py \
    --workdir="$OUT_DIR/grpo_moe_replay_$replay" --config.model.family=mixtral \
    --config.moe.num_experts=8 --config.moe.experts_per_token=2 --config.moe.expert_mlp_dim=64 \
    --config.model.dtype=bfloat16 --config.grpo.replay_routing=$replay \
    --config.train.steps=10 --config.train.log_every=1 --config.train.eval_every=1000 \
    --config.log.tensorboard=False 2>&1 | tail -2 | tee "$OUT_DIR/grpo_replay_$replay.log"
  "$PY" - "$OUT_DIR/grpo_moe_replay_$replay/metrics.jsonl" "$replay" <<'PY'
import json, sys
gaps = [json.loads(l)["logprob_mismatch"] for l in open(sys.argv[1]) if '"logprob_mismatch"' in l]
print(f"grpo_mismatch: replay={sys.argv[2]} steps={len(gaps)} max={max(gaps):.3g} "
      f"mean={sum(gaps) / len(gaps):.3g}")
PY
done
