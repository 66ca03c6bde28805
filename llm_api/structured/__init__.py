"""Structured output: what a request's answer must follow, compiled once, enforced token by token.

One module per concept, imported by module (importing the package costs nothing):

- ``spec``: ``GrammarSpec`` (a JSON schema, JSON object, regex, EBNF or structural tag as text),
  ``Constraint`` (a spec and the request field it came from), the compile-cost limits (``GrammarLimits``,
  ``check_limits``) and ``GrammarError``. No torch, no xgrammar: the request formats build specs here.
- ``compiler``: ``GrammarCompiler`` (one per model; thread-safe, for a worker pool) and its bounded cache
  of ``CompiledGrammar``.
- ``matcher``: ``GrammarMatcher`` (one sequence's grammar state, engine thread only), ``step_mask`` (a
  step's masks, asked by whoever owns the step) and ``advance`` (the tokens the step took).
- ``bitmask``: the mask format, ``TokenMask`` and ``apply_bitmask``: the only part the sampler uses; it
  applies a mask it is given and never advances a matcher.
- ``library``: the one (lazy) import of xgrammar.

Layers: below the request formats (``api``), which build specs, and the engine, which runs matchers;
nothing here imports any other part of ``llm_api``. Compiling on behalf of requests (queues, fair shares,
deadlines) is the service's (``llm_api.service.grammars``).
"""
