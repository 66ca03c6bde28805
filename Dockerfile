# CPU image: TorchServe + llm_api serving the embedded SmolLM2-135M-Instruct (prepared at build time).
#   docker build -t llm_api .
#   docker run --rm -p 127.0.0.1:8080:8080 -p 127.0.0.1:7070:7070 -p 127.0.0.1:8082:8082 llm_api
# Ports: 8080 HTTP inference, 7070 gRPC inference, 8082 Prometheus metrics. The management ports
# (8081, 7071) stay inside the container. The inference key is in /home/llm/app/key_file.json:
#   docker exec <container> cat /home/llm/app/key_file.json
# Another model: mount a checkpoint and set MODEL_PATH, e.g. -v /models/x:/models/x -e MODEL_PATH=/models/x
# CUDA variant: start FROM an nvidia/cuda runtime image with Python 3.11 and build with
#   --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# gcc and libc6-dev: the CPU kernels (llm_api/kernels/cpu) are compiled for the CPU the container runs on, at
# the first start there (about a second; without a compiler the servers run transformers' slower code).
# Unpinned on purpose: Debian replaces package versions with security updates, so pins break builds;
# the base image tag fixes the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless make gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 llm
# Numeric, so a runtime (and Kubernetes runAsNonRoot) can verify it is not root.
USER 1000
WORKDIR /home/llm/app
ENV LLM_API_CACHE=/home/llm/.cache/llm_api \
    MODEL_NAME=smollm2 \
    TORCH_SPEC=${TORCH_SPEC} \
    PYTHONUNBUFFERED=1

COPY --chown=llm:llm pyproject.toml README.md Makefile config.properties model-config.yaml ./
COPY --chown=llm:llm llm_api ./llm_api
COPY --chown=llm:llm scripts ./scripts
COPY --chown=llm:llm proto ./proto
# Set up the venv and the embedded model now, so the container starts without a network.
RUN scripts/setup.sh

# Inside the container the servers must listen beyond loopback; the published ports decide who reaches them.
ENV TS_INFERENCE_ADDRESS=http://0.0.0.0:8080 \
    TS_METRICS_ADDRESS=http://0.0.0.0:8082 \
    TS_GRPC_INFERENCE_ADDRESS=0.0.0.0
# 8080, 7070, 8082: TorchServe (the entrypoint); 8000, 50051: `llm_api serve` (deploy/standalone-deployment.yaml)
EXPOSE 8080 7070 8082 8000 50051
ENTRYPOINT ["scripts/serve.sh"]
