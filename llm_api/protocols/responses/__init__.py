"""The OpenAI Responses API (``v1/responses``): ``schema``, ``translate`` (the contract), ``encoder``
(``ResponsesCall``), ``route`` (create, retrieve, delete, cancel)."""
