#!/usr/bin/env bash
# The test suite. Extra arguments go to pytest (e.g. bash scripts/test.sh -k drafter -x).
source "$(dirname "$0")/setup_env.sh"
# Reference material (benchmark files, golden checkpoints) from a shared folder beside the
# repository, unless the variables already name it; tests that need it skip without it.
shared="$ROOT/../shared"
if [ -d "$shared" ]; then
  shared="$(cd "$shared" && pwd)"
  export DSPARK_SHARED="${DSPARK_SHARED:-$shared}"
  export DSPARK_GOLDEN="${DSPARK_GOLDEN:-$DSPARK_SHARED/golden}"
  export DSPARK_EVAL_DATA="${DSPARK_EVAL_DATA:-$DSPARK_SHARED/eval_datasets}"
fi
exec python -m pytest -q -ra "$@"
