"""What can be known to fail before a server listens: the settings, and the model's files where that is cheap.

``check(settings)`` raises the ``ConfigError`` that loading would raise later, for the cases a look at the files
answers: bitsandbytes missing for QUANTIZATION=8bit/4bit; MODEL_PATH neither a checkpoint folder nor a GGUF file;
for a checkpoint folder, its tokenizer files unreadable (tokenizer_config.json not a JSON object, tokenizer.json
not one the ``tokenizers`` library reads: a truncated download names the file); and for a GGUF file, QUANTIZATION
set beside it, a GPU device map, and the whole file checked without reading its weights
(``llm_api.model.gguf_file``'s header and tensor table, the architecture, the rotary scaling, every tensor's name,
shape and type against the model's: ``llm_api.model.gguf_model.check_tensors``; ~0.1 s for the embedded model's
file). ``llm_api serve`` runs it before it opens a port, so such a start exits 2 with one line naming the file and
the reason, instead of a traceback from the loading thread of a server that already answers ``/health``;
``make serve`` runs ``python -m llm_api.model.preflight`` before it builds the archive.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from llm_api.model.settings import BITSANDBYTES_SCHEMES, ConfigError, Settings, check_model_path, parse_device_map


def check(settings: Settings) -> None:
    # Found, not imported: importing bitsandbytes (and the torch it loads) took 7-10 s of every quantized
    # `make serve` on a 2-core host, before TorchServe even starts; the worker imports it at load anyway.
    if settings.quantization in BITSANDBYTES_SCHEMES and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"QUANTIZATION={settings.quantization} needs bitsandbytes: "
                          f"pip install 'llm_api[quant]' (make serve installs it when QUANTIZATION is set)")
    gguf = check_model_path(settings.model_path)
    if gguf is None:
        from llm_api.model.tokenizer import check_tokenizer_files

        try:
            check_tokenizer_files(Path(settings.model_path))
        except ValueError as error:
            raise ConfigError(f"MODEL_PATH={settings.model_path!r}: {error}") from None
        return
    if settings.quantization != "none":
        raise ConfigError(f"MODEL_PATH={settings.model_path!r} is a GGUF file, whose weights are already quantized: "
                          f"unset QUANTIZATION={settings.quantization} (it quantizes Hugging Face checkpoints at load)")
    device_map = parse_device_map(settings.device_map)
    if device_map not in ("auto", "cpu"):
        raise ConfigError(f"MODEL_PATH={settings.model_path!r}: GGUF files are served on the CPU (DEVICE_MAP=cpu or "
                          f"auto); their quantized products have no GPU kernels yet")
    from llm_api.model.gguf_file import GGUFFile
    from llm_api.model.gguf_model import check_tensors, gguf_config

    with GGUFFile.open(Path(gguf)) as file:
        check_tensors(file, gguf_config(file))


def main() -> int:
    """``python -m llm_api.model.preflight``: check the environment's settings and model before a server starts
    (exit 2 with the reason on stderr)."""
    try:
        settings = Settings.from_env()
        check(settings)
    except ConfigError as err:
        print(f"llm_api: {err}", file=sys.stderr)
        return 2
    print(f"llm_api: settings OK (model {settings.model_name} from {settings.model_path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
