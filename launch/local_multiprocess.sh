#!/usr/bin/env bash
# Runs NUM_PROCESSES processes of `python -m jaxtrain.main ARGS...` on this machine as one
# multi-process JAX run, the way NUM_PROCESSES hosts would: each process gets 8/NUM_PROCESSES
# emulated CPU devices and the coordinator, process count and id in JAX_* variables, and CPU
# collectives run over localhost (gloo). For trying multi-host features without a cluster.
#
#   launch/local_multiprocess.sh NUM_PROCESSES -- ARGS...
#   launch/local_multiprocess.sh 2 -- --config=configs/tiny.py --config.train.steps=20
#
# Environment (all optional): PYTHON (default: the repository's .venv/bin/python, else python3),
# DEVICES (emulated devices in total, default 8), PORT (coordinator port, default: a free one),
# XLA_FLAGS (kept; the device count is appended).
# Output: process 0's as is, the others' lines prefixed with "[process I]". SIGINT and SIGTERM
# are passed to every process as SIGTERM, which JAX's preemption service turns into a common
# stopping step (with a checkpoint when checkpoint.every_steps > 0). Exit status: 0 when every
# process succeeded, else the first failure's.
set -euo pipefail

usage() {
  echo "usage: $0 NUM_PROCESSES -- ARGS...   (ARGS go to python -m jaxtrain.main)" >&2
  exit 2
}
[[ $# -ge 2 && "$2" == "--" && "$1" =~ ^[1-9][0-9]*$ ]] || usage
num_processes=$1
shift 2
devices=${DEVICES:-8}
if (( devices % num_processes )); then
  echo "error: $num_processes processes cannot share $devices devices evenly; use a divisor" \
       "of $devices, or set DEVICES" >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-}
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
port=${PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# Each process in its own process group (job control), so a Ctrl-C reaches them only through
# the trap below, once, as the SIGTERM every process handles the same way.
set -m
pids=()
forward() {
  echo "local_multiprocess: $1: stopping all $num_processes processes" >&2
  kill -TERM "${pids[@]}" 2>/dev/null || true
}
trap 'forward SIGINT' INT
trap 'forward SIGTERM' TERM

for ((i = 0; i < num_processes; i++)); do
  export JAX_PLATFORMS=cpu JAX_COORDINATOR_ADDRESS="127.0.0.1:$port"
  export JAX_NUM_PROCESSES=$num_processes JAX_PROCESS_ID=$i
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$((devices / num_processes))"
  if (( i == 0 )); then
    "$python" -m jaxtrain.main "$@" &
  else
    "$python" -m jaxtrain.main "$@" > >(sed -u "s/^/[process $i] /") 2>&1 &
  fi
  pids+=($!)
  XLA_FLAGS=${XLA_FLAGS% --xla_force_host_platform_device_count=*}
done

status=0
for i in "${!pids[@]}"; do
  while true; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    # A trapped signal interrupts `wait` (status > 128) while the process still runs.
    if (( rc > 128 )) && kill -0 "${pids[$i]}" 2>/dev/null; then continue; fi
    break
  done
  if (( rc != 0 )); then
    echo "local_multiprocess: process $i exited with status $rc" >&2
    (( status != 0 )) || status=$rc
  fi
done
wait  # the output filters
exit "$status"
