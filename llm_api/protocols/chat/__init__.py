"""OpenAI chat completions (``POST v1/chat/completions``): ``schema``, ``translate`` (the contract), ``route``;
the encoder, shared with completions, is ``llm_api.protocols.common.openai_call``."""
