#!/usr/bin/env bash
# Build the TorchServe archive for $MODEL_NAME into model-store/ (a folder: --archive-format
# no-archive). The weights stay at $MODEL_PATH; the archive carries the handler and model-config.yaml.
# Usage: scripts/build_archive.sh [MODEL_CONFIG_YAML]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
config="${1:-model-config.yaml}"
mkdir -p model-store
# The archiver stages in $TMPDIR/$MODEL_NAME and deletes it afterwards: a private TMPDIR keeps two builds
# (two checkouts, a test run beside) from deleting each other's staging folder.
staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
TMPDIR="$staging" torch-model-archiver --model-name "$MODEL_NAME" --version 1.0 --handler llm_api/torchserve/llm_handler.py \
  --archive-format no-archive --export-path model-store --config-file "$config" --force
echo "archive: model-store/$MODEL_NAME"
