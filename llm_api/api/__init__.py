"""What every request format shares (each API's own schema, translation and encoder are in
``llm_api.protocols``): the engine request every API produces (``request``: ``GenerateRequest``,
``Limits``), prompts (``prompt``), structured-output constraints (``constraints``) and the encoder
protocol (``encoding``). Below the service, above the engine: no TorchServe, no sockets."""
