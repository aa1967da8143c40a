#!/usr/bin/env bash
# Evaluate a drafter: bash scripts/eval.sh --draft DIR --out DIR [dspark eval options]
# Several processes (prompts sharded across ranks): NPROC=8 bash scripts/eval.sh ...
source "$(dirname "$0")/setup_env.sh"
if [ "${NPROC:-1}" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NPROC" -m dspark.cli eval "$@"
fi
exec dspark eval "$@"
