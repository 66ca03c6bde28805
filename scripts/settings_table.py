"""Write the README's table of environment variables from the settings' declarations (never edit it by hand).

Usage: python scripts/settings_table.py [--write | --check]   (`make settings-table` writes)

Without an option it prints the table. ``--write`` replaces the README's text between the two markers
(``BEGIN`` and ``END`` below) with it; ``--check`` exits 1 when the README's table differs from it.
The table comes from ``llm_api.model.settings.readme_table``: each row is one ``setting(...)`` declaration
of ``Settings``, so a setting's doc is edited there. tests/test_config.py fails while the README is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN = "<!-- settings table: generated from llm_api/model/settings.py by scripts/settings_table.py --write -->"
END = "<!-- end of the settings table -->"


def with_table(readme: str, table: str) -> str:
    """``readme`` with the text between the markers replaced by ``table`` (a blank line on each side, so the
    markers never join the table)."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    if end < start:
        raise ValueError(f"README.md: {END!r} comes before {BEGIN!r}")
    return readme[:start] + "\n\n" + table + "\n" + readme[end:]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))  # the checkout's llm_api, installed or not
    from llm_api.model.settings import readme_table

    table = readme_table()
    if argv[1:] == []:
        print(table, end="")
        return 0
    readme = README.read_text()
    fresh = with_table(readme, table)
    if argv[1:] == ["--write"]:
        if fresh != readme:
            README.write_text(fresh)
            print("README.md: settings table rewritten")
        return 0
    if argv[1:] == ["--check"]:
        if fresh != readme:
            print("README.md: the settings table is stale: run python scripts/settings_table.py --write",
                  file=sys.stderr)
            return 1
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
