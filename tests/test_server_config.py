"""A user's own TorchServe configuration, as the common TorchServe LLM guide writes it.

The guide puts a ``models={...}`` block in config.properties (batchSize 2, maxBatchDelay 1000,
responseTimeout 600). With the archive's model-config.yaml, the yaml wins for every value it sets (so the
shipped async mode keeps batchSize 1) and the block fills in the rest: every stream must complete, with
its own text. An async yaml that leaves batchSize to such a block would get batches, which TorchServe's
async aggregator cannot take (every request in flight would hang): the worker refuses to load, saying
why, instead of serving requests it would lose.
"""

from __future__ import annotations

import threading

import pytest

from llm_api.client import HTTPClient

pytestmark = pytest.mark.server
MARKER = "<|endoftext|>"
GUIDE_MODELS_BLOCK = (
    '\nmodels={"smollm2": {"1.0": {"defaultVersion": true, "marName": "smollm2", "minWorkers": 1, "maxWorkers": 1, '
    '"batchSize": 2, "maxBatchDelay": 1000, "responseTimeout": 600}}}\n'
)
QUESTIONS = {"france": "What is the capital of France?", "japan": "What is the capital of Japan?",
             "germany": "What is the capital of Germany?", "colours": "Name three colours."}


def test_the_guides_config_properties_serves_every_stream_its_own_answer(start_server):
    from bench.harness.torchserve_server import REPO

    # float32 pinned on every host: with DTYPE unset the host's CPU picks the dtype, and in bfloat16 a batched greedy answer
    # may part from the solo one at a one-ulp tie (what this test compares is the guide's batching).
    server = start_server("guide", (REPO / "model-config.yaml").read_text(), extra_properties=GUIDE_MODELS_BLOCK,
                          env={"DTYPE": "float32"})
    try:
        http = HTTPClient(server.http, "smollm2", server.key())
        answers: dict = {}

        def ask(question):
            return "".join(http.stream({"messages": [{"role": "user", "content": question}], "max_new_tokens": 24}))

        def ask_into(name, question):
            try:
                answers[name] = ask(question)
            except Exception as exc:  # reported below
                answers[name] = exc

        threads = [threading.Thread(target=ask_into, args=item) for item in QUESTIONS.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        # Each stream complete and its own: the same greedy answer as the question asked alone.
        for name, question in QUESTIONS.items():
            assert isinstance(answers.get(name), str) and answers[name] == ask(question), (name, answers.get(name))
        assert "Paris" in answers["france"] and "Tokyo" in answers["japan"]
        assert "batch_size=1" in server.wait_for_log_lines("LLMHandler ready")[0]
    finally:
        server.stop()


def test_async_mode_with_batches_refuses_to_load(start_server):
    async_without_batch_size = "minWorkers: 1\nmaxWorkers: 1\nasyncCommunication: true\nresponseTimeout: 600\n"
    server = start_server("async-batched", async_without_batch_size, extra_properties=GUIDE_MODELS_BLOCK,
                          wait_ready=False)
    try:
        # The rendered message, not the needle alone: the traceback also logs the raising source line, which
        # holds the same words with "{batch_size}" and may reach the log first.
        lines = server.wait_for_log_lines("asyncCommunication needs batchSize 1, got 2:", timeout=180)
        assert lines, server.model_log()[-3000:]
        assert server.worker_status() != "READY"
    finally:
        server.stop()
