"""The request formats, one folder per API, and the one route table every edge serves.

Each API's folder (``native``, ``chat``, ``completions``, ``responses``, ``tokenize``) has the same rooms:
``schema`` (the body as pydantic models), ``translate`` (the body -> ``GenerateRequest``, or the API's own
request, raising ``ApiError`` naming the field), ``encoder`` (the service's events -> the wire format: an
``AnswerEncoder``) and ``route`` (the answer functions the table names). ``probes`` and ``lora`` hold the
probe and adapter-management routes. ``common`` holds what the APIs share: the one ``to_sampling_params``
and the checks every API applies alike (docs/architecture.md, "Where a new API goes").

``route`` holds the types every edge and route share (``Call``, ``RouteContext``, ``Whole``, ``Streamed``,
``Route``); ``table`` the table (``ROUTES``, ``find``).

Layer: above ``llm_api.service`` (a route parses, asks the service to generate and encodes), below the
edges, which import only ``route`` and ``table`` of this package (tests/test_architecture.py).
"""
