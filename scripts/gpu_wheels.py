"""Wheels packed small enough for one call to a lent GPU machine (64 MiB carried), and unpacked there.

A wheel is a deflate zip; TorchServe's holds a 46 MB jar (itself a deflate zip of 163 MB of classes), and
transformers' 13 MB of Python source. Unzipped and xz-compressed together they take about half:
``pack`` writes every wheel's files (a jar inside exploded too, as ``NAME.jar.d/``) into one tar.xz;
``unpack`` rebuilds each jar and wheel from those files (stored, not deflated: they only travel to pip) and
corrects the jar's line in the wheel's RECORD, since a rebuilt jar has other bytes than the original.
Every other file keeps its bytes, so RECORD's hashes still hold and pip installs the wheels as usual.

  python scripts/gpu_wheels.py pack .gpu/wheels.tar.xz WHEEL...      # here (scripts/gpu_prepare.sh)
  python scripts/gpu_wheels.py unpack .gpu/wheels.tar.xz DIR          # there: DIR/*.whl (scripts/gpu_check.sh)
"""

from __future__ import annotations

import base64
import hashlib
import io
import lzma
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

JAR_DIR_SUFFIX = ".jar.d"


def pack(archive: Path, wheels: list[Path]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for wheel in wheels:
            tree = root / wheel.name  # the folder keeps the wheel's file name (pip reads tags from it)
            with zipfile.ZipFile(wheel) as zipped:
                zipped.extractall(tree)
            for jar in list(tree.rglob("*.jar")):
                with zipfile.ZipFile(jar) as zipped:
                    zipped.extractall(jar.with_name(jar.name[: -len(".jar")] + JAR_DIR_SUFFIX))
                jar.unlink()
        # preset 9: the classes and sources compress to about a third of their deflated size
        with lzma.open(archive, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            for tree in sorted(root.iterdir()):
                tar.add(tree, arcname=tree.name)


def _zip_folder(folder: Path, target: Path) -> None:
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as zipped:
        # A jar's manifest goes first, where java's tools look for it.
        files = sorted((p for p in folder.rglob("*") if p.is_file()),
                       key=lambda p: (p.relative_to(folder).as_posix() != "META-INF/MANIFEST.MF", p.as_posix()))
        for path in files:
            zipped.write(path, path.relative_to(folder).as_posix())


def _record_hash(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def unpack(archive: Path, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        with lzma.open(archive) as xz, tarfile.open(fileobj=io.BufferedReader(xz), mode="r") as tar:
            tar.extractall(root, filter="data")
        for tree in sorted(root.iterdir()):
            jars = {}
            for folder in sorted(tree.rglob("*" + JAR_DIR_SUFFIX)):
                jar = folder.with_name(folder.name[: -len(JAR_DIR_SUFFIX)] + ".jar")
                _zip_folder(folder, jar)
                shutil.rmtree(folder)
                jars[jar.relative_to(tree).as_posix()] = f"{_record_hash(jar)},{jar.stat().st_size}"
            if jars:
                (record,) = tree.glob("*.dist-info/RECORD")
                lines = []
                for line in record.read_text().splitlines():
                    name = line.split(",", 1)[0]
                    lines.append(f"{name},{jars[name]}" if name in jars else line)
                record.write_text("\n".join(lines) + "\n")
            wheel = out_dir / tree.name
            _zip_folder(tree, wheel)
            built.append(wheel)
    return built


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "pack":
        pack(Path(argv[1]), [Path(p) for p in argv[2:]])
        return 0
    if len(argv) == 3 and argv[0] == "unpack":
        for wheel in unpack(Path(argv[1]), Path(argv[2])):
            print(wheel)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
