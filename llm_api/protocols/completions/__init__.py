"""OpenAI legacy completions (``POST v1/completions``): ``schema``, ``translate`` (the contract), ``route``;
the encoder, shared with chat, is ``llm_api.protocols.common.openai_call``."""
