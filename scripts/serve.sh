#!/usr/bin/env bash
# The main job: set up, build the archive, and serve the model with TorchServe in the foreground.
# Stop with Ctrl-C. Settings come from the environment (see README: MODEL_PATH, DTYPE, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/env.sh
# A bad setting or model file stops here with its message, before TorchServe would restart a failing worker
# forever (llm_api.model.preflight).
python -m llm_api.model.preflight
scripts/build_archive.sh
cat <<MSG

llm_api: starting TorchServe for model '$MODEL_NAME' (config.properties: 127.0.0.1 only).
Once "WORKER_MODEL_LOADED" appears, in another shell:
  KEY=\$(python3 -c "import json; print(json.load(open('key_file.json'))['inference']['key'])")
  curl -N -H "Authorization: Bearer \$KEY" -H 'Content-Type: application/json' \\
       http://127.0.0.1:8080/predictions/$MODEL_NAME \\
       -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
  gRPC: 127.0.0.1:7070 (StreamPredictions with input {"text": ..., "stream": "true"}); see README.

MSG
exec torchserve --start --foreground --ncs --ts-config config.properties --model-store model-store --models "$MODEL_NAME"
