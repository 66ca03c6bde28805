"""One model served: what every front end does with a request between its transport and the engine.

``request`` (what the request formats hand the service: ``GenerateRequest``, ``Limits``), ``admission`` (every
limit a request must meet, checked once, and the measure of a request's work), ``constraints`` (a request's
structured-output fields and tools -> its ``Constraint``; the tools' plan), ``prompt`` (a request's prompt ids:
the chat template, contents kept as data), ``service`` (``ModelService``: the loaded model, its engine or
reference path, adapters, the live requests), ``input`` (a request's prompt prepared: template, tokens, grammar),
``output`` (engine outputs -> text deltas, logprobs and choice ends), ``events`` (those events), ``encoding``
(``AnswerEncoder``: the protocol every output format implements over them), ``answer`` (parse, admit, drive and
encode: the steps shared by every edge), ``engine_loop`` (the engine's steps on their own thread), ``grammars``
(structured output compiled off the event loop, shared out by owner), ``owners`` (who sent a request: stored
responses' owners and the engine's fair-share tenants), ``metrics`` (the service's counters, for whichever sink
the edge has). Imports nothing from the edges (``server``, ``torchserve``, ``scale_out``) or the request formats
(``protocols``), which import it: tests/test_architecture.py.
"""
