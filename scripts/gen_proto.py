"""Generate the gRPC stubs in llm_api/proto/ from the .proto files in proto/ (never edit them by hand).

Usage: python scripts/gen_proto.py [OUT_ROOT]   (default: the repository root)

The protos are TorchServe 0.12's own (from ts/frontend/model-server.jar). They are mapped to the
virtual path llm_api/proto/ so the generated modules import each other as ``llm_api.proto.*``;
google/rpc/status.proto resolves to googleapis-common-protos' ``google.rpc.status_pb2`` at run time.
tests/test_proto.py regenerates into a temporary folder and checks the committed stubs match.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ("inference.proto", "management.proto")


def generate(out_root: Path) -> None:
    out_root.mkdir(parents=True, exist_ok=True)
    grpc_include = Path(protoc.__file__).parent / "_proto"
    for name in PROTOS:
        args = [
            "protoc",
            f"-Illm_api/proto={ROOT / 'proto'}",
            f"-I{ROOT / 'proto' / 'third_party'}",
            f"-I{grpc_include}",
            f"--python_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"llm_api/proto/{name}",
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {name}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
