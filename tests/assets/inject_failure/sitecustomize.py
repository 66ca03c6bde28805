"""A failure injected into a real server (tests/test_edge_failures.py, tests/test_scale_out.py): on PYTHONPATH with
``LLM_API_INJECT_FAILURE=after-first-chunk``, every answer's parts (``llm_api.service.answer``) raise right after
their first chunk, as a bug in the engine or an encoder would, so each edge's writing of a failure mid-stream can
be seen on the wire. With ``LLM_API_INJECT_FAILURE=after-first-chunk-while:<path>``, only while the file
``<path>`` exists (checked at each answer): a long-lived server shared with other tests (Ray Serve's) fails only
the requests sent while the test holds the file.

Python imports this module at the start of every process that has it on its path (the server, TorchServe's
worker, gRPC's, and under Ray every process of the cluster: its agents too). So it imports nothing of llm_api
itself: it patches ``llm_api.service.answer`` when some process imports it (an import hook), and a process that
never serves answers (Ray's agents, whose start has a deadline) loads nothing more. Nothing happens without the
variable."""

import os
import sys

_MODE = os.environ.get("LLM_API_INJECT_FAILURE", "")
_TARGET = "llm_api.service.answer"


def _patch(answer) -> None:
    from contextlib import aclosing

    encoded_parts = answer._encoded_parts
    condition = _MODE.partition(":")[2]

    async def _failing_after_the_first_chunk(generations, encoder):
        inject = not condition or os.path.exists(condition)
        async with aclosing(encoded_parts(generations, encoder)) as parts:
            async for part in parts:
                yield part
                if inject and isinstance(part, answer.Chunk):
                    raise RuntimeError("a failure injected after the first chunk")

    answer._encoded_parts = _failing_after_the_first_chunk


class _PatchOnImport:
    """A meta path finder that lets the other finders find ``llm_api.service.answer`` and patches the module
    right after it runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, _run=run):
                    _run(module)
                    _patch(module)

                spec.loader.exec_module = exec_module  # (this module's own loader object)
                return spec
        return None


if _MODE == "after-first-chunk" or _MODE.startswith("after-first-chunk-while:"):
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
