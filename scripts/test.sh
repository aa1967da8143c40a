#!/usr/bin/env bash
# The test suite. Extra arguments go to pytest (e.g. bash scripts/test.sh -k drafter -x).
source "$(dirname "$0")/setup_env.sh"
exec python -m pytest -q -ra "$@"
