#!/usr/bin/env bash
# Pack, here, what a GPU machine without network lacks for the GPU checks (issues 11 and 26), into .gpu/
# (ignored by git), all of it within one call of the device tool that lends such machines (64 MiB carried,
# the working tree included):
#   .gpu/wheels.tar.xz  the wheels (CPython 3.12 or GPU_PYTHON_VERSION, manylinux x86-64) of the versions the
#                       tests here run with, for what a stock CUDA PyTorch image has in another version or
#                       not at all: transformers, pydantic (+ pydantic-core, annotated-types,
#                       typing-inspection), xgrammar (+ apache-tvm-ffi), grpcio, protobuf and
#                       googleapis-common-protos (the generated gRPC code asks for these versions or newer;
#                       the image has no google.rpc), torchserve and torch-model-archiver;
#                       unzipped and xz-packed by scripts/gpu_wheels.py (70 MB of wheels, about 33 MB packed)
#   .gpu/model          the embedded model's config, tokenizer and chat template, without weights: the GPU
#                       tests save random weights of that shape (tests/test_gpu_serving.py)          ~3.5 MB
#   .gpu/jre.tar.xz     a Java 17 runtime cut down by jlink to what TorchServe's frontend uses        ~17 MB
# scripts/gpu_check.sh is the other half (run there); docs/benchmarks.md, "On a GPU machine without network".
# Needs: scripts/setup.sh test done (the versions are read from .venv), a JDK 17 with jlink, PyPI.
# GPU_PYTHON_VERSION: the GPU machine's Python (default 3.12, the CUDA image's).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
version() { python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
fetch() {  # fetch DIR SPEC...: wheels for that CPython on x86-64 Linux, without their dependencies
  local dir=$1; shift
  mkdir -p "$dir"
  python -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation cp \
    "${platforms[@]}" -d "$dir" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}

rm -rf .gpu && mkdir -p .gpu
base=()
for package in transformers pydantic pydantic-core annotated-types typing-inspection xgrammar apache-tvm-ffi \
               grpcio protobuf googleapis-common-protos; do
  base+=("$package==$(version "$package")")
done
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
fetch "$wheels" "${base[@]}" "torchserve==$(version torchserve)" "torch-model-archiver==$(version torch-model-archiver)"
python scripts/gpu_wheels.py pack .gpu/wheels.tar.xz "$wheels"/*.whl

model=$(python -m llm_api.model.embedded --checkpoint)
mkdir -p .gpu/model
for name in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$model/$name" ] && cp "$model/$name" .gpu/model/
done

# TorchServe 0.12's frontend (netty, gson, log4j, which needs java.beans from java.desktop) runs on these
# modules (checked by starting it, tests/test_gpu_serving.py); uncompressed in the image, then xz, which
# packs it to about half of what jlink's own compression gives.
java_home=${JAVA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")}
"$java_home/bin/jlink" --add-modules java.base,java.desktop,java.logging,java.management,java.naming,java.sql,java.xml,\
jdk.unsupported,java.net.http,java.security.jgss,jdk.crypto.ec,java.instrument,jdk.management,jdk.zipfs \
  --strip-debug --no-header-files --no-man-pages --compress=0 --output .gpu/jre
tar -C .gpu -cf - jre | xz -9 -T0 > .gpu/jre.tar.xz
rm -rf .gpu/jre

du -sh .gpu/wheels.tar.xz .gpu/model .gpu/jre.tar.xz
echo "one call carries .gpu: $(du -shL .gpu | cut -f1) (plus the working tree)"
