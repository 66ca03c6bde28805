"""The request formats, one folder per API, and the one route table every edge serves.

Each API's folder (``native``, ``chat``, ``completions``, ``responses``, ``tokenize``; ``probes`` and
``lora`` hold the probe and adapter-management routes) holds its route (``route.py``: the answer
functions the table names). ``route`` holds the types every edge and route share (``Call``,
``RouteContext``, ``Whole``, ``Streamed``, ``Route``); ``table`` the table (``ROUTES``, ``find``).

Layer: above ``llm_api.service`` (a route parses, asks the service to generate and encodes), below the
edges, which import only ``route`` and ``table`` (tests/test_architecture.py).
"""
