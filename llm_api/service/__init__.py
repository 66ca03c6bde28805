"""One model served: what every front end does with a request between its transport and the engine.

``service`` (``ModelService``: the loaded model, its engine or reference path, adapters, the live requests),
``admission`` (every limit a request must meet, checked once), ``input`` (a request's prompt prepared:
template, tokens), ``output`` (engine outputs -> text deltas,
logprobs and choice ends), ``events`` (those events), ``answer`` (parse, admit, drive and encode: the steps
shared by every edge), ``engine_loop`` (the engine's steps on their own thread), ``grammars`` (structured
output compiled off the event loop, shared out by owner), ``owners`` (who sent a request: stored responses'
owners and the engine's fair-share tenants), ``metrics`` (the service's counters, for whichever sink the edge
has). Imports nothing from the edges (``server``, ``torchserve``, ``scale_out``) or the request formats
(``protocols``): tests/test_architecture.py.
"""
