"""Which checkpoint folder a benchmark loads.

``model_dir(explicit)`` is ``explicit`` (a script's ``--model``) when given, else ``$MODEL_PATH`` when set,
else the embedded model as a checkpoint folder in the llm_api cache (``llm_api.model.settings.default_checkpoint_path``:
the served default is its GGUF file, ``default_model_path``), prepared there first if it is not yet
(``llm_api.model.embedded.prepare``: a download and a conversion, once per cache).
The folder is returned as given; nothing is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path


def model_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    if explicit:
        return Path(explicit)
    if os.environ.get("MODEL_PATH"):
        return Path(os.environ["MODEL_PATH"])
    from llm_api.model.embedded import prepare, prepare_gguf
    from llm_api.model.settings import default_checkpoint_path, default_model_path

    return prepare(default_checkpoint_path(os.environ), prepare_gguf(default_model_path(os.environ)))
