"""examples/client_examples.ipynb runs top to bottom, headless, against the shipped async server."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parent.parent


def test_client_examples_notebook_runs(async_server, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # The kernel inherits this process's environment: point the notebook at the test server.
    monkeypatch.setenv("LLM_API_URL", async_server.http)
    monkeypatch.setenv("LLM_API_GRPC", async_server.grpc)
    monkeypatch.setenv("LLM_API_KEY", async_server.key())
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(REPO / "examples" / "client_examples.ipynb", as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Paris" in outputs and "tokens in" in outputs
