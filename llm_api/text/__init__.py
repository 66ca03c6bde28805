"""Model-family text handling: what a model's tokenizer and chat template decide about the text going in and out.

``tools`` (each family's tool-call format: found in the chat template, its grammar, the streaming parser of
calls; the generic form for a template without one), ``reasoning`` (the ``<think>`` block: the family's style,
the streaming split of reasoning from answer, the answer-only grammar, the chat template's extra variables),
``detokenizer`` (token ids -> text as it streams: stop strings, the end-of-stream marker kept out) and
``logprobs`` (a token's logprob entries with the token's text and bytes, and their renderings).

Layer: below the service (which renders prompts and detokenizes with these) and the request formats (which
parse tools and reasoning out of answers), above the engine, whose token ids and logprobs it turns into text.
It raises ``ApiError`` (``llm_api.errors``), builds grammar specs (``llm_api.structured.spec``) and reads the
engine's ``TokenLogprob`` (``llm_api.engine.request``); nothing of the service or the request formats
(tests/test_architecture.py).
"""
