"""The standalone edge: ``llm_api serve``, one process serving the model over HTTP and gRPC without TorchServe.

``cli`` (the command), ``server`` (starts both listeners on one event loop, loads the model, drains on
SIGTERM), ``http_api`` (aiohttp routes: native, OpenAI, tokenizer, health, metrics), ``grpc_api``
(TorchServe's ``inference.proto`` service on ``grpc.aio``), ``auth`` (the bearer key), ``tls`` (the key,
certificate and client CA of both ports), ``lifecycle`` (readiness, draining, in-flight requests),
``transport`` and ``connections`` (what a client can hold of the server), ``metrics`` (prometheus_client). It
calls the same service and request formats as the TorchServe edge (``llm_api.service.answer``) and imports
nothing of TorchServe.
"""
