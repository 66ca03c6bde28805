"""``python -m llm_api.server ...``: the same as the ``llm_api`` command."""

from llm_api.server.cli import main

raise SystemExit(main())
