"""A failure injected into a real server (tests/test_edge_failures.py): on PYTHONPATH with
``LLM_API_INJECT_FAILURE=after-first-chunk``, every answer's parts (``llm_api.service.answer``) raise right
after their first chunk, as a bug in the engine or an encoder would, so each edge's writing of a failure
mid-stream can be seen on the wire. Python imports this module at the start of every process that has it on its
path (the server, TorchServe's worker, gRPC's); nothing happens without the variable."""

import os

if os.environ.get("LLM_API_INJECT_FAILURE") == "after-first-chunk":
    from contextlib import aclosing

    import llm_api.service.answer as answer

    _encoded_parts = answer._encoded_parts

    async def _failing_after_the_first_chunk(generations, encoder):
        async with aclosing(_encoded_parts(generations, encoder)) as parts:
            async for part in parts:
                yield part
                if isinstance(part, answer.Chunk):
                    raise RuntimeError("a failure injected after the first chunk")

    answer._encoded_parts = _failing_after_the_first_chunk
