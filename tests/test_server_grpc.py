"""gRPC against both front ends: streaming opt-in, unary answers in one message, errors."""

import grpc
import pytest

from llm_api.client import GRPCClient, RequestRefused
from llm_api.proto import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.server
MARKER = "<|endoftext|>"


@pytest.fixture()
def stub(frontend):
    channel = grpc.insecure_channel(frontend.grpc)
    yield inference_pb2_grpc.InferenceAPIsServiceStub(channel), (("authorization", f"Bearer {frontend.key()}"),)
    channel.close()


def test_stream_predictions_multi_chunk_ends_with_marker(stub):
    service, auth = stub
    request = inference_pb2.PredictionsRequest(
        model_name="smollm2", input={"text": b"The capital of France is", "stream": b"true", "max_new_tokens": b"24"}
    )
    messages = [r.prediction.decode() for r in service.StreamPredictions(request, metadata=auth, timeout=120)]
    assert len(messages) > 3
    assert messages[-1].endswith(MARKER) and "".join(messages).count(MARKER) == 1


def test_unary_gets_whole_answer_and_worker_survives(stub, frontend):
    service, auth = stub
    request = inference_pb2.PredictionsRequest(model_name="smollm2", input={"text": b"The capital of France is", "max_new_tokens": b"12"})
    answer = service.Predictions(request, metadata=auth, timeout=120).prediction.decode()
    assert answer.endswith(MARKER) and len(answer) > len(MARKER)
    # A unary call on the streaming RPC without the flag gets one message too.
    messages = list(service.StreamPredictions(request, metadata=auth, timeout=120))
    assert len(messages) == 1 and messages[0].prediction.decode() == answer
    assert frontend.worker_status() == "READY"
    client = GRPCClient(frontend.grpc, "smollm2", frontend.key())
    assert "".join(client.stream({"text": "Hello", "max_new_tokens": "8"}))


def test_grpc_client_chat_and_errors(frontend):
    with GRPCClient(frontend.grpc, "smollm2", frontend.key()) as client:
        answer = "".join(client.stream({"messages": '[{"role": "user", "content": "What is the capital of France?"}]', "max_new_tokens": "24"}))
        assert "Paris" in answer
        with pytest.raises(RequestRefused) as err:
            client.generate({"text": "a", "temperature": "-2"})
        assert err.value.error["type"] == "invalid_parameter"
        with pytest.raises(RequestRefused):
            list(client.stream({"text": "a", "top_p": "7"}))


def test_grpc_without_key_is_refused(frontend):
    with grpc.insecure_channel(frontend.grpc) as channel:
        service = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="smollm2", input={"text": b"hi"})
        with pytest.raises(grpc.RpcError) as err:
            service.Predictions(request, timeout=30)
        assert err.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.parametrize("script, needle", [("http_stream.py", "Paris"), ("grpc_stream.py", "unary:")])
def test_example_scripts(frontend, script, needle):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "LLM_API_HTTP": frontend.http, "LLM_API_GRPC": frontend.grpc}
    if frontend.kind == "standalone":  # its key is not in a TorchServe key_file.json
        env["LLM_API_KEY"] = frontend.key()
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(repo / "examples" / script)], cwd=frontend.workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert needle in done.stdout and MARKER not in done.stdout
