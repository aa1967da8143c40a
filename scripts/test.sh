#!/usr/bin/env bash
# The test suite. Extra arguments go to pytest (e.g. bash scripts/test.sh -k drafter -x).
# The golden fixtures ship in tests/golden ($DSPARK_GOLDEN names another copy). The benchmark files
# come from a shared folder beside the repository, unless the variables already name them; tests
# that need them skip without them. Above pytest's final count, one line counts the skipped tests by
# what they need (tests/conftest.py).
source "$(dirname "$0")/setup_env.sh"
shared="$ROOT/../shared"
if [ -d "$shared" ]; then
  shared="$(cd "$shared" && pwd)"
  export DSPARK_SHARED="${DSPARK_SHARED:-$shared}"
  export DSPARK_EVAL_DATA="${DSPARK_EVAL_DATA:-$DSPARK_SHARED/eval_datasets}"
fi
exec python -m pytest -q -ra "$@"
