#!/usr/bin/env bash
# Set up and serve the model with `llm_api serve` (the standalone server, no TorchServe) in the
# foreground; stop with Ctrl-C (it drains). Extra arguments go to `llm_api serve` (--host, --port, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. scripts/env.sh
exec llm_api serve "$@"
