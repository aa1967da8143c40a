#!/usr/bin/env bash
# Train a drafter: bash scripts/train.sh CONFIG [--set key=value ...] [--resume]
# Several processes: NPROC=8 bash scripts/train.sh CONFIG  (torchrun; NCCL on GPU, gloo on CPU)
source "$(dirname "$0")/setup_env.sh"
cfg="${1:?usage: bash scripts/train.sh CONFIG [dspark train options]}"; shift
if [ "${NPROC:-1}" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NPROC" -m dspark.cli train --config "$cfg" "$@"
fi
exec dspark train --config "$cfg" "$@"
