"""The request formats: native (``/predictions/<model>``, gRPC) and OpenAI (``/v1/...``) parsing into one
``GenerateRequest``, one error type rendered per format (``errors``), strict JSON decoding
(``validation``), and turning token ids into what a client receives (``detokenizer``, ``native_stream``,
``openai``). Below the service, above the engine: no TorchServe, no sockets."""
