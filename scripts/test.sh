#!/usr/bin/env bash
# Set up (with test tools) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
. scripts/env.sh
exec python -m pytest "$@"
