#!/usr/bin/env bash
# Build llama.cpp and the embedded model's GGUF files for bench/peer_llamacpp.py (the side by side
# with llama.cpp, docs/benchmarks.md). Not part of CI or of setup: a benchmark aid, run by hand.
#
#   scripts/build_llamacpp.sh            (after scripts/setup.sh, which prepares the embedded model)
#
# Everything lands under .cache/llamacpp/ (git-ignored), idempotently; each step is skipped when its
# output is there:
#   dl/      the llama-cpp-python sdist from PyPI: its vendor/llama.cpp is a pinned llama.cpp
#            checkout, so PyPI alone gives a reproducible llama.cpp source (no GitHub access needed)
#   src/     the unpacked sdist
#   build/   cmake build (Release, GGML_NATIVE: the host's AVX2/AVX-512/AMX paths), bin/llama-bench
#            and bin/llama-server, statically linked
#   pylib/   the gguf package from PyPI and its dependencies (numpy, pyyaml, tqdm, requests), kept out
#            of .venv; torch, transformers and safetensors for the converter come from .venv
#   gguf/    SmolLM2-135M-Instruct-f32.gguf and -bf16.gguf, converted from the embedded checkpoint
#   build-info.txt   the llama.cpp commit, the sdist version and the GGUF paths
#
# Settings (environment): JOBS (default 2) build jobs; NICE (default 10) niceness of the build and
# the conversion; MODEL_PATH the HF checkpoint to convert (default: the embedded model's cache);
# LLAMA_CPP_PYTHON_SPEC the sdist to take (default llama-cpp-python==0.3.36: llama.cpp 0c1e570; to
# change it on a machine that built another, remove .cache/llamacpp first: the steps skip what exists).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="$root/.cache/llamacpp"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
PY="$root/.venv/bin/python"
[ -x "$PY" ] || { echo "build_llamacpp: run scripts/setup.sh first (.venv missing)" >&2; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$out/dl" "$out/src" "$out/gguf"

# 1. The source: the llama-cpp-python sdist, pinned (0.3.36 vendors llama.cpp 0c1e570, the build issue 25
# measured), so a rebuild measures the same llama.cpp.
spec="${LLAMA_CPP_PYTHON_SPEC:-llama-cpp-python==0.3.36}"
if ! ls "$out"/dl/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  echo "build_llamacpp: downloading the $spec sdist"
  "$PY" -m pip download -q --no-binary :all: --no-deps -d "$out/dl" "$spec" 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
fi
sdist="$(ls "$out"/dl/llama_cpp_python-*.tar.gz | sort -V | tail -1)"
name="$(basename "$sdist" .tar.gz)"
if [ ! -f "$out/src/$name/vendor/llama.cpp/CMakeLists.txt" ]; then
  echo "build_llamacpp: unpacking $name"
  rm -rf "${out:?}/src/$name"
  tar xzf "$sdist" -C "$out/src"
fi
llama="$out/src/$name/vendor/llama.cpp"
# The sdist keeps the submodule's (shallow) git directory, so the commit is known; the build number
# that llama.cpp derives from the history length is meaningless in a shallow clone (it reads 1).
commit="$(git -C "$llama" rev-parse --short=7 HEAD 2>/dev/null || echo unknown)"

# 2. The binaries. Static, so they run without LD_LIBRARY_PATH; no curl/OpenSSL/web UI (nothing is
# fetched: the benchmark hands llama-server a local GGUF).
if [ ! -x "$out/build/bin/llama-bench" ] || [ ! -x "$out/build/bin/llama-server" ]; then
  echo "build_llamacpp: building llama.cpp $commit (nice $NICE, $JOBS jobs)"
  nice -n "$NICE" cmake -S "$llama" -B "$out/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
  nice -n "$NICE" cmake --build "$out/build" -j "$JOBS" --target llama-bench llama-server
fi

# 3. The converter's Python side: the gguf package from PyPI, in its own folder (not in .venv, whose
# installs setup.sh owns). Only the dependencies .venv lacks (or holds at a version gguf does not take)
# go there too: a second numpy ahead of .venv's on the path would be the one torch meets. The converter
# puts the checkout's own gguf-py (the same package, at the version the converter was written against)
# ahead of it on sys.path; the PyPI one is the fallback (NO_LOCAL_GGUF=1). The converter also imports
# sentencepiece for every Llama checkpoint (before it looks for a tokenizer.model); the rest of its
# requirements file (transformers 4.x, numpy 2.2) is not taken: .venv's transformers reads the checkpoint.
if [ ! -f "$out/pylib/.installed" ]; then
  echo "build_llamacpp: installing gguf from PyPI into $out/pylib"
  "$PY" -m pip install -q --no-deps --target "$out/pylib" gguf 2>&1 | { grep -v "^WARNING: Location" || true; }
  missing="$(PYTHONPATH="$out/pylib" "$PY" -c '
from importlib import metadata
from packaging.requirements import Requirement
for line in [*(metadata.requires("gguf") or ()), "sentencepiece>=0.1.98,<0.3.0"]:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        if req.specifier.contains(metadata.version(req.name), prereleases=True):
            continue
    except metadata.PackageNotFoundError:
        pass
    print(str(req.name) + str(req.specifier))
')"
  if [ -n "$missing" ]; then
    echo "build_llamacpp: and what of its dependencies .venv lacks: $missing"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --target "$out/pylib" $missing 2>&1 | { grep -v "^WARNING: Location" || true; }
  fi
  touch "$out/pylib/.installed"
fi

# 4. The GGUF files, from the same checkpoint llm_api serves.
model="${MODEL_PATH:-$("$PY" -c 'import os; from llm_api.model.settings import default_model_path; print(default_model_path(os.environ))')}"
[ -f "$model/config.json" ] || { echo "build_llamacpp: no checkpoint at $model (run scripts/setup.sh)" >&2; exit 1; }
for type in f32 bf16; do
  gguf="$out/gguf/SmolLM2-135M-Instruct-$type.gguf"
  if [ ! -s "$gguf" ]; then
    echo "build_llamacpp: converting $model to $type"
    PYTHONPATH="$out/pylib" nice -n "$NICE" "$PY" "$llama/convert_hf_to_gguf.py" "$model" \
      --outtype "$type" --outfile "$gguf.part" >"$out/gguf/convert-$type.log" 2>&1 \
      || { tail -20 "$out/gguf/convert-$type.log" >&2; exit 1; }
    mv "$gguf.part" "$gguf"
  fi
done

cat >"$out/build-info.txt" <<EOF
llama_cpp_commit=$commit
sdist=$name
llama_bench=$out/build/bin/llama-bench
llama_server=$out/build/bin/llama-server
gguf_f32=$out/gguf/SmolLM2-135M-Instruct-f32.gguf
gguf_bf16=$out/gguf/SmolLM2-135M-Instruct-bf16.gguf
model=$model
EOF
echo "build_llamacpp: ready (llama.cpp $commit)"
cat "$out/build-info.txt"
