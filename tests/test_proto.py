"""The committed gRPC stubs are exactly what scripts/gen_proto.py makes from proto/."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_stubs_match_protos(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    for name in ("inference_pb2.py", "inference_pb2_grpc.py", "management_pb2.py", "management_pb2_grpc.py"):
        fresh = (tmp_path / "llm_api" / "proto" / name).read_text()
        committed = (REPO / "llm_api" / "proto" / name).read_text()
        assert fresh == committed, f"llm_api/proto/{name} is stale: run `make proto`"


def test_stubs_import_and_describe_the_service():
    from llm_api.proto import inference_pb2, inference_pb2_grpc

    service = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"]
    assert {m.name for m in service.methods} >= {"Ping", "Predictions", "StreamPredictions"}
    assert hasattr(inference_pb2_grpc, "InferenceAPIsServiceStub")
