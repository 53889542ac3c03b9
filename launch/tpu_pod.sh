#!/usr/bin/env bash
# Trains on every worker of a Cloud TPU VM slice (a pod slice such as v4-32, v5p-64, v5e-32):
# copies this working tree to all workers, installs it once (--setup), then starts the same
# `python -m jaxtrain.main ARGS...` on all workers at once. JAX finds the workers, the
# coordinator (worker 0) and each process id itself, from the TPU VM metadata.
#
#   launch/tpu_pod.sh TPU_NAME ZONE [--setup] [--print] -- ARGS...
#   launch/tpu_pod.sh my-v5p-32 us-east5-a --setup -- --config=configs/llama8b.py \
#       --config.checkpoint.directory=gs://my-bucket/llama8b --config.checkpoint.every_steps=500
#
# Needs gcloud, logged in, with access to an existing TPU VM (gcloud compute tpus tpu-vm create).
# Environment (optional): PROJECT (default: gcloud's configured project), REMOTE_DIR (the
# copy's directory under each worker's home, default jaxtrain).
# --print writes the gcloud commands it would run, one per line, and runs nothing.
# Every worker prints to this terminal; the run's metrics.jsonl is on worker 0. Checkpoints must
# go to storage every worker can write, e.g. a gs:// bucket (see docs/launch.md).
set -euo pipefail

usage() {
  echo "usage: $0 TPU_NAME ZONE [--setup] [--print] -- ARGS...   (ARGS go to python -m" \
       "jaxtrain.main; --print: show the gcloud commands instead of running them)" >&2
  exit 2
}
[[ $# -ge 3 ]] || usage
tpu=$1 zone=$2
shift 2
setup=0 print_only=0
while [[ $# -gt 0 && "$1" != "--" ]]; do
  case "$1" in
    --setup) setup=1 ;;
    --print) print_only=1 ;;
    *) echo "error: unknown option $1" >&2; usage ;;
  esac
  shift
done
[[ $# -ge 1 && "$1" == "--" ]] || usage
shift
remote_dir=${REMOTE_DIR:-jaxtrain}
gcloud_args=(--zone="$zone" --worker=all)
if [[ -n "${PROJECT:-}" ]]; then gcloud_args+=(--project="$PROJECT"); fi
# Runs a command, or with --print writes it as one line of shell words (printf %q), to stdout.
run() {
  if (( print_only )); then printf '%q ' "$@"; echo; else "$@"; fi
}
on_all_workers() {
  run gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --command="$1"
}

# The tracked and untracked-but-not-ignored files: the working tree without .venv, runs/, ...
repo=$(cd "$(dirname "$0")/.." && pwd)
if (( print_only )); then
  archive="${TMPDIR:-/tmp}/jaxtrain.XXXXXX.tgz"  # not made: nothing runs
else
  archive=$(mktemp "${TMPDIR:-/tmp}/jaxtrain.XXXXXX.tgz")
  trap 'rm -f "$archive"' EXIT
  git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | tar -C "$repo" --null -T - -czf "$archive"
  echo "tpu_pod: copying $(du -h "$archive" | cut -f1) of $repo to every worker of $tpu" >&2
fi
run gcloud compute tpus tpu-vm scp "$archive" "$tpu:/tmp/jaxtrain.tgz" "${gcloud_args[@]}"
on_all_workers "mkdir -p ~/$remote_dir && tar -xzf /tmp/jaxtrain.tgz -C ~/$remote_dir"

if (( setup )); then
  (( print_only )) || echo "tpu_pod: installing jaxtrain[tpu,cloud] into ~/$remote_dir/.venv on" \
    "every worker" >&2
  on_all_workers "cd ~/$remote_dir && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu,cloud]'"
fi

# printf %q keeps every argument one word through the remote shell.
(( print_only )) || echo "tpu_pod: starting python -m jaxtrain.main on every worker of $tpu" >&2
on_all_workers "cd ~/$remote_dir && exec .venv/bin/python -m jaxtrain.main $(printf '%q ' "$@")"
