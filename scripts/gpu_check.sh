#!/usr/bin/env bash
# On a GPU machine without network (issues 11 and 26): install what scripts/gpu_prepare.sh packed into .gpu/,
# then check. Each call carries .gpu (wheels, model files, Java: about 55 MiB).
#   bash scripts/gpu_check.sh all           # in one call (~7 minutes on an H200): versions; correctness
#                                           # (below); bench/gpu_gemv.py --quick (the one-row product); then
#                                           # bench/gpu_decode.py for Llama-3.1-8B shapes at batch 1 and 64
#                                           # with the fused decoder layers on and off, batch 1 with cuBLAS
#                                           # for every product (and the products alone), SmolLM2-135M
#                                           # with graphs on and off, a 4k-token prefill;
#                                           # bench/gpu_step_profile.py (Llama-3.1-8B,
#                                           # batch 1); bench/lora.py at batch 16; a summary last
#   BENCH_NAME=smollm2 bash scripts/gpu_check.sh bench --models smollm2-135m --batches 1,64 --compile-batches ""
#                                           # SmolLM2-135M with graphs on and off (~40 s)
#   bash scripts/gpu_check.sh correctness   # the kernel, CUDA-graph, engine-vs-generate(), LoRA, grammar,
#                                           # n > 1, speculation and KV-sizing tests on the GPU; both front
#                                           # ends (`llm_api serve`, TorchServe) streaming from the GPU
#   bash scripts/gpu_check.sh bench ARGS    # bench/gpu_decode.py ARGS, its JSON in $OUT/$BENCH_NAME.json
#   bash scripts/gpu_check.sh setup         # installs what the call carried and prints the versions
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?usage: scripts/gpu_check.sh all|correctness|bench ARGS|setup}
env_dir=/tmp/llm_api-gpu
out=${OUT:-$env_dir/out}
machine_python=${PYTHON:-python3}

if [ ! -x "$env_dir/bin/python" ]; then
  "$machine_python" -m venv --without-pip "$env_dir" || exit
  own=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  "$machine_python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > "$own/machine-packages.pth"
fi
mkdir -p "$out"
python=$env_dir/bin/python
install() {  # the machine's pip, run by this environment's python: console scripts start this python;
  # -I: the machine's own copies (seen through the .pth) are shadowed, never uninstalled
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir -I "$@"
}
if [ -f .gpu/wheels.tar.xz ] && [ ! -f "$env_dir/wheels-installed" ]; then
  wheels=$(mktemp -d)
  "$machine_python" scripts/gpu_wheels.py unpack .gpu/wheels.tar.xz "$wheels" >/dev/null || exit
  install "$wheels"/*.whl || exit
  rm -rf "$wheels" && touch "$env_dir/wheels-installed"
fi
if [ -f .gpu/jre.tar.xz ]; then tar -C "$env_dir" -xJf .gpu/jre.tar.xz || exit; fi
if [ -x "$env_dir/jre/bin/java" ]; then export JAVA_HOME="$env_dir/jre"; fi
export PATH="$env_dir/bin${JAVA_HOME:+:$JAVA_HOME/bin}:$PATH" PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1  # a test that would fetch the embedded model fails at once instead of waiting on a network
if [ -d .gpu/model ]; then rm -rf "$env_dir/model" && cp -r .gpu/model "$env_dir/model"; fi  # for a later call too
if [ -d "$env_dir/model" ]; then export GPU_MODEL_FILES="$env_dir/model"; fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$python" - <<'EOF'
import importlib.metadata as m, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(), "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for name in ("triton", "transformers", "tokenizers", "pydantic", "xgrammar", "grpcio", "protobuf", "torchserve"):
    try:
        print(f"  {name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"  {name} (not installed)")
EOF
  command -v java >/dev/null && java -version 2>&1 | head -1
} 2>&1 | tee "$out/$what-versions.txt"

pytest() {  # pytest NAME ARGS...: one run, its log and JUnit XML under $out
  local name=$1; shift
  "$python" -m pytest -q -p no:cacheprovider -rs --timeout 600 --junitxml "$env_dir/$name.xml" "$@" 2>&1 \
    | tee "$out/$name.log"
  return "${PIPESTATUS[0]}"
}
correctness() {  # the GPU-marked tests, and the kernel and engine files that run on CUDA when it is there
  # (the files that need the embedded model's weights are left out: the machine lacks them), 8 at a time.
  # (tests/test_bench_gpu_decode.py is not here: its smoke run times generate() on the CPU, which 8 busy
  # test processes disturb; CI runs it.)
  pytest correctness -n 8 tests/kernels tests/engine/test_gpu_fast_path.py tests/engine/test_cuda_graphs.py \
    tests/engine/test_memory_sizing.py tests/test_gpu_serving.py \
    "tests/engine/test_model_support.py::test_model_split_over_gpu_and_cpu_matches_model_in_one_piece" \
    "tests/engine/test_grammar.py::test_apply_bitmask_on_cuda_matches_the_reference"
}
bench() {  # bench NAME SECONDS ARGS...: one bench/gpu_decode.py run, killed after SECONDS, its JSON and log in $out
  local name=$1 seconds=$2; shift 2
  timeout -k 10 "$seconds" "$python" bench/gpu_decode.py --out "$out/$name.json" "$@" 2>&1 | tee -a "$out/bench.log"
  return "${PIPESTATUS[0]}"
}
case "$what" in
  correctness) correctness ;;
  all)
    # Within one call (~6 minutes on an H200): each stage has its own limit, so a hang costs that stage
    # only; the benchmarks run after the tests, alone on the GPU; --max-seconds leaves each run time to
    # write its table. The fused decoder layers on and off (issue 39: the fused form before them) on the
    # same machine, one after the other.
    timeout -k 10 150 bash -c "$(declare -f pytest correctness); python=$python out=$out env_dir=$env_dir; correctness" >/dev/null
    tests=$?
    if [ "$tests" = 124 ] && [ -n "${OUT:-}" ]; then  # (on the lent machine only, which runs nothing else:)
      # servers of a test cut off by the limit run on in their own sessions, holding GPU memory
      pkill -f "llm_api[.]server serve|org[.]pytorch[.]serve[.]ModelServer|model_service_worker"
    fi
    echo "== tests: exit $tests; $(grep -E "passed|failed" "$out/correctness.log" | tail -1)"
    grep -E "^(FAILED|ERROR) " "$out/correctness.log"
    # The one-row product kernel's candidates against cuBLAS (its table into bench.log; without --quick,
    # bench/gpu_gemv.py runs the whole grid the candidates were chosen from)
    timeout -k 5 100 "$python" bench/gpu_gemv.py --quick --out "$env_dir/gemv.json" >> "$out/bench.log" 2>&1
    bench llama-fused 120 --models llama-3.1-8b --batches 1,64 --compile-batches "" --max-seconds 90 >/dev/null
    bench llama-library 80 --models llama-3.1-8b --batches 1 --compile-batches "" --max-seconds 50 --no-gemv \
      >/dev/null
    bench llama-norms 80 --models llama-3.1-8b --batches 1,64 --compile-batches "" --max-seconds 50 \
      --no-fused-layers >/dev/null
    bench smollm2 40 --models smollm2-135m --batches 1 --compile-batches "" --max-seconds 25 >/dev/null
    bench prefill-4k 45 --models llama-3.1-8b --batches 1 --context-len 4096 --steps 8 --compile-batches "" \
      --max-seconds 25 >/dev/null
    # (into bench.log: the device tool brings back 8 files at most, and the versions, test log, bench log and
    # five JSON files make 8)
    timeout -k 5 50 "$python" bench/gpu_step_profile.py --model llama-3.1-8b --batch 1 --steps 20 \
      >> "$out/bench.log" 2>&1
    # Mixed LoRA adapters at batch 16 against the base (issue 24's bench, the embedded model's shapes)
    MODEL_PATH=$GPU_MODEL_FILES DEVICE_MAP=cuda DTYPE=bfloat16 KV_CACHE_MEMORY_MIB=1024 MAX_NUM_SEQS=16 \
      timeout -k 5 60 "$python" bench/lora.py --random-weights --requests 16 --tokens 64 --rounds 3 \
      >> "$out/bench.log" 2>&1
    grep -E '"(mixed|swapped)_over_base"' "$out/bench.log"
    "$python" bench/gpu_decode.py --summarize "$out"/llama-fused.json "$out"/llama-library.json \
      "$out"/llama-norms.json "$out"/smollm2.json "$out"/prefill-4k.json
    ;;
  bench)
    shift
    bench "${BENCH_NAME:-gpu_decode}" 590 "$@"
    ;;
  setup) ;;
  *) echo "unknown check $what: all, correctness, bench or setup" >&2; exit 2 ;;
esac
