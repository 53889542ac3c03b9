#!/usr/bin/env bash
# Writes the Kubernetes JobSet that trains jaxtrain on GKE, for TPU slices or GPU nodes, to
# stdout: launch/gke_jobset.yaml with your values filled in, after checking them. Apply it with
# kubectl (the file is the dry run: read it first if you like).
#
#   export JOB_NAME=llama8b IMAGE=us-docker.pkg.dev/my-project/ml/jaxtrain:latest \
#     ARGS="--config=configs/llama8b.py --config.checkpoint.directory=gs://my-bucket/llama8b"
#   NUM_SLICES=2 TPU_ACCELERATOR=tpu-v5p-slice TPU_TOPOLOGY=2x2x4 HOSTS_PER_SLICE=4 \
#     CHIPS_PER_HOST=4 launch/gke_jobset.sh tpu | kubectl apply -f -
#   NUM_HOSTS=2 GPUS_PER_HOST=8 launch/gke_jobset.sh gpu | kubectl apply -f -
#
# Variables: JOB_NAME (the JobSet's name: lowercase letters, digits and '-'), IMAGE (an image
# with this repository installed, working directory the repository), ARGS (the arguments of
# `python -m jaxtrain.main`, as shell words); for tpu NUM_SLICES, TPU_ACCELERATOR, TPU_TOPOLOGY,
# HOSTS_PER_SLICE, CHIPS_PER_HOST; for gpu NUM_HOSTS, GPUS_PER_HOST. Needs envsubst (gettext).
set -euo pipefail

fail() { echo "gke_jobset: error: $*" >&2; exit 2; }
[[ $# -eq 1 && ( "$1" == tpu || "$1" == gpu ) ]] || {
  echo "usage: $0 tpu|gpu > jobset.yaml   (values from the environment; see the header)" >&2
  exit 2
}
accelerator=$1
counts=(NUM_SLICES HOSTS_PER_SLICE CHIPS_PER_HOST)
[[ $accelerator == gpu ]] && counts=(NUM_HOSTS GPUS_PER_HOST)
names=(JOB_NAME IMAGE ARGS "${counts[@]}")
[[ $accelerator == tpu ]] && names+=(TPU_ACCELERATOR TPU_TOPOLOGY)

for name in "${names[@]}"; do
  [[ -n "${!name:-}" ]] || fail "$name is not set; $accelerator needs ${names[*]}"
done
for name in "${counts[@]}"; do
  [[ "${!name}" =~ ^[1-9][0-9]*$ ]] || fail "$name=${!name}: must be a positive integer"
done
# Pods are reached as <JOB_NAME>-<job>-<index>-<pod>.<JOB_NAME>: each part a DNS label.
[[ "$JOB_NAME" =~ ^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$ ]] || fail "JOB_NAME=$JOB_NAME: use 1 to" \
  "40 lowercase letters, digits and '-', starting with a letter (it names pods and DNS records)"
[[ "$ARGS" != *$'\n'* ]] || fail "ARGS: one line of arguments, please"
command -v envsubst > /dev/null || fail "envsubst not found: install gettext (apt-get install" \
  "gettext-base, brew install gettext)"

# Only the listed variables are substituted (the file's other $ signs stay), then the one
# document labelled for this accelerator is kept.
template="$(dirname "$0")/gke_jobset.yaml"
envsubst "$(printf '${%s} ' "${names[@]}")" < "$template" | awk -v want="$accelerator" '
  /^---$/ { flush(); next }
  { doc = doc $0 "\n" }
  /^    jaxtrain-accelerator: / { label = $2 }
  function flush() { if (label == want) printf "%s", doc; doc = ""; label = "" }
  END { flush() }'
