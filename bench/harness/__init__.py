"""The one harness every script in bench/ is built on; a script is its argument parsing, its measurement, and
calls into these modules:

- ``models``: which checkpoint folder a benchmark loads (``model_dir``).
- ``host``: what the figures were measured on: the CPU model, the feature flags that pick the kernels
  (avx2, avx512*, amx*), cores, torch and its threads (``cpu_model``, ``cpu_flags``, ``describe``).
- ``stats``: percentiles (``nearest_rank``, ``quantile_summary``).
- ``report``: a markdown table (``markdown_table``), and where a JSON report goes (``results_path``,
  ``write_json``).
- ``llamacpp``: what scripts/build_llamacpp.sh built (``build_info``, the GGUF files by ``--formats`` name,
  ``describe_gguf``: size and tensor types) and ``LlamaServer``; ``ppl``: llama-perplexity's method (chunks,
  the scored half, the estimate), standard library only.
- the server launchers: ``server_process`` (``ServerProcess``: own ports, working directory and TMPDIR, started
  under ``process_guard`` and stopped by its process group only), ``standalone_server`` (``llm_api serve``),
  ``torchserve_server`` (TorchServe from the repo's handler); and ``hostile``, the witness stream that
  measures how long a request stalls the others.

Why the launchers live here and the tests import them (``from bench.harness.torchserve_server import
TorchServe``): a benchmark and a test start servers the same way, so there is one launcher, and it has to sit
where both can import it without editing ``sys.path``. A script run as ``python bench/x.py`` has ``bench/`` on
its path and nothing else of the checkout, so it imports ``harness.*``; pytest puts the repository root on the
path (``pythonpath`` in pyproject.toml), so the tests import ``bench.harness.*`` (``bench`` is a namespace
package). The modules import one another relatively, so either name works. The launchers keep the test
suite's footprint rules (at most ``MAX_LIVE_SERVERS`` per process, a small default KV pool unless the caller
sizes it): a benchmark that sizes its server passes ``KV_CACHE_MEMORY_MIB`` in ``env``.

Nothing here does work at import time; torch and llm_api are imported inside the functions that need them, so
``--help`` stays fast and the pure-Python parts (``stats``, ``report``) run without either.
"""
