"""What every request format shares (each API's own schema, translation and encoder are in
``llm_api.protocols``): the engine request every API produces (``request``: ``GenerateRequest``,
``Limits``), prompts (``prompt``), structured-output constraints
(``constraints``), tool formats (``tools``), reasoning parsers (``reasoning``), logprobs, the encoder
protocol (``encoding``) and turning token ids into text (``detokenizer``). Below the service, above the
engine: no TorchServe, no sockets."""
