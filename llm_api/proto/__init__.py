"""Generated gRPC stubs for TorchServe's inference and management APIs (see scripts/gen_proto.py)."""
