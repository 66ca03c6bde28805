"""llama.cpp's own tokenizer tests, for ours: the vocabulary-only GGUF files of its models/ folder
(``ggml-vocab-<name>.gguf``) with their texts (``.inp``, separated by ``__ggml_vocab_test__`` lines) and the ids
the model's original Hugging Face tokenizer gives them (``.out``, one line a text, no BOS), which llama.cpp's
tests (tests/test-tokenizer-0.cpp) hold its tokenizers to.

``vocab_files(names)`` -> the folder holding them: taken from the llama-cpp-python sdist that
scripts/build_llamacpp.sh uses (its vendor/llama.cpp is the pinned llama.cpp), from PyPI into the same
``.cache/llamacpp/dl`` when it is not there yet (~8 s, 76 MB, once per clone), only these files extracted (into
``.cache/llamacpp/vocab``).
"""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "llamacpp"
SDIST = "llama-cpp-python==0.3.36"  # (scripts/build_llamacpp.sh's default: the same llama.cpp, 0c1e570)
SDIST_FILE = CACHE / "dl" / f"llama_cpp_python-{SDIST.split('==')[1]}.tar.gz"  # (where pip download puts it)
SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_files(names: list[str]) -> Path:
    folder = CACHE / "vocab"
    wanted = [f"ggml-vocab-{name}.gguf{suffix}" for name in names for suffix in ("", ".inp", ".out")]
    if all((folder / name).is_file() for name in wanted):
        return folder
    (CACHE / "dl").mkdir(parents=True, exist_ok=True)
    with open(CACHE / "dl" / ".lock", "w") as lock:  # (test workers of one run fetch it once)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not SDIST_FILE.is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                            "-d", str(CACHE / "dl"), SDIST], check=True, timeout=600)
        folder.mkdir(parents=True, exist_ok=True)
        pattern = re.compile(r"^[^/]+/vendor/llama\.cpp/models/(ggml-vocab-[\w.-]+)$")
        with tarfile.open(SDIST_FILE) as archive:
            for member in archive:
                found = pattern.match(member.name)
                if found and found[1] in wanted and member.isfile():
                    source = archive.extractfile(member)
                    assert source is not None
                    (folder / found[1]).write_bytes(source.read())
    missing = [name for name in wanted if not (folder / name).is_file()]
    assert not missing, f"not in {SDIST_FILE.name}: {missing}"
    return folder


def cases(folder: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, the original tokenizer's ids) for each of the vocabulary's test texts."""
    texts = (folder / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    if texts and texts[-1].endswith(SEPARATOR.rstrip("\n")):
        texts[-1] = texts[-1][:-len(SEPARATOR.rstrip("\n"))]
    ids = [[int(i) for i in line.split()] for line in
           (folder / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()]
    assert len(ids) in (len(texts), len(texts) - 1), (name, len(texts), len(ids))  # (a trailing separator)
    return list(zip(texts, ids))
