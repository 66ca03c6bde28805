"""How a benchmark reports: a markdown table on stdout and a JSON document on disk.

``markdown_table(header, rows, align)``: a GitHub markdown table; each cell is ``str()`` of what is given, so
a script formats its own numbers; ``align`` has one letter per column, ``l`` (left) or ``r`` (right), all
left when omitted. ``results_path(name, out)``: ``out`` when given, else
``bench/results/<name>-<local time>.json`` (bench/results/ is not tracked). ``write_json(path, doc)`` writes
``doc`` indented, creating the folder, and returns the path.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"


def markdown_table(header: Sequence[object], rows: Iterable[Sequence[object]], align: str | None = None) -> str:
    if align is None:
        align = "l" * len(header)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one of 'l' or 'r' per column ({len(header)})")
    lines = [_row(header), "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {row!r}")
        lines.append(_row(row))
    return "\n".join(lines)


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def results_path(name: str, out: str | os.PathLike[str] | None = None) -> Path:
    if out:
        return Path(out)
    return RESULTS / f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"


def write_json(path: str | os.PathLike[str], doc: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return path
