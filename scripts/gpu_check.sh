#!/usr/bin/env bash
# On a GPU machine without network (issue 11): install what scripts/gpu_prepare.sh packed into .gpu/, then check.
#   bash scripts/gpu_check.sh correctness   # carries .gpu/base .gpu/model .gpu/jre.tar.xz: versions; the kernel,
#                                           # CUDA-graph, engine-vs-generate(), KV-sizing tests on the GPU;
#                                           # `llm_api serve` streaming from the GPU
#   bash scripts/gpu_check.sh torchserve    # carries .gpu/torchserve, on the same machine right after:
#                                           # TorchServe streaming from the GPU
#   bash scripts/gpu_check.sh bench ARGS    # bench/gpu_decode.py ARGS, its JSON in $OUT (carries .gpu/base
#                                           # unless the machine is still warm from a call that did)
#   bash scripts/gpu_check.sh setup         # installs what the call carried and prints the versions
# Everything installs into one environment, /tmp/llm_api-gpu: a venv without pip that sees the machine's own
# packages (torch, Triton, CUDA) after its own, so the carried versions win and a second call on the same
# machine finds the first call's installs. Logs and JUnit XML go to $OUT (the device tool brings them back)
# or /tmp/llm_api-gpu/out. PYTHON names the machine's interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?usage: scripts/gpu_check.sh correctness|torchserve|bench ARGS|setup}
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
for group in base torchserve; do
  if [ -d ".gpu/$group" ]; then install .gpu/$group/*.whl || exit; fi
done
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
  "$python" -m pytest -q -p no:cacheprovider -rs --timeout 600 --junitxml "$out/$name.xml" "$@" 2>&1 \
    | tee "$out/$name.log"
  return "${PIPESTATUS[0]}"
}
case "$what" in
  correctness)
    # The GPU-marked tests, and the kernel and engine files that run on CUDA when it is there (within one
    # call's 10 minutes; the files that need the embedded model's weights are left out: the machine lacks them).
    pytest correctness tests/kernels tests/engine/test_gpu_fast_path.py tests/engine/test_cuda_graphs.py \
      tests/engine/test_memory_sizing.py tests/test_bench_gpu_decode.py \
      "tests/engine/test_model_support.py::test_model_split_over_gpu_and_cpu_matches_model_in_one_piece" \
      "tests/engine/test_grammar.py::test_apply_bitmask_on_cuda_matches_the_reference" \
      "tests/test_gpu_serving.py::test_standalone_streams_from_the_gpu"
    ;;
  torchserve)
    pytest torchserve "tests/test_gpu_serving.py::test_torchserve_streams_from_the_gpu"
    ;;
  bench)
    shift
    "$python" bench/gpu_decode.py --out "$out/gpu_decode.json" "$@" 2>&1 | tee "$out/bench.log"
    exit "${PIPESTATUS[0]}"
    ;;
  setup) ;;
  *) echo "unknown check $what: correctness, torchserve, bench or setup" >&2; exit 2 ;;
esac
