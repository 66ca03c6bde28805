"""Every script in bench/ still starts: what it imports from llm_api and from its harness (bench/harness/)
exists, and ``--help`` prints its usage. The benchmarks run by hand, between changes that rename modules;
without this a script rots unseen (bench/grammar_overhead.py imported two modules that had been gone for
months, issue 35). No script edits ``sys.path`` (a script run as ``python bench/x.py`` reaches the harness as
its sibling package), and the harness's pure-Python parts (percentiles, the markdown table, the report path)
are checked on known inputs, in-process and in milliseconds.

The script checks run in one child process, so torch and the package are imported once for all the scripts:
the imports are read from each script's syntax tree (function-level ones included, which ``--help`` never
reaches), then each script runs as ``__main__`` with ``--help`` and must exit 0 having printed a usage line.
The child's path is the repository and bench/ only, as for a script run by hand: tests/ is not on it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import report, stats

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "bench").glob("*.py"))

CHECK = r"""
import ast, contextlib, importlib, io, json, runpy, sys
from pathlib import Path

repo = Path(sys.argv[1])
sys.path[:0] = [str(repo), str(repo / "bench")]
local = {p.stem for p in (repo / "bench").glob("*.py")} | {"harness"}
problems = {}
for script in sys.argv[2:]:
    found = []
    for node in ast.walk(ast.parse(Path(script).read_text(), script)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top == "llm_api" or top in local:
                try:
                    module = importlib.import_module(node.module)
                except Exception as exc:
                    found.append(f"line {node.lineno}: from {node.module}: {exc!r}")
                    continue
                for alias in node.names:
                    if alias.name != "*" and not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except Exception:
                            found.append(f"line {node.lineno}: {node.module} has no {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "llm_api":
                    try:
                        importlib.import_module(alias.name)
                    except Exception as exc:
                        found.append(f"line {node.lineno}: import {alias.name}: {exc!r}")
    out = io.StringIO()
    sys.argv = [script, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
        found.append("--help returned instead of exiting")
    except SystemExit as exit:
        if exit.code not in (0, None):
            found.append(f"--help exited {exit.code}: {out.getvalue()[-300:]}")
        elif "usage:" not in out.getvalue():
            found.append(f"--help printed no usage: {out.getvalue()[:200]!r}")
    except BaseException as exc:
        found.append(f"--help raised {exc!r}")
    if found:
        problems[Path(script).name] = found
print(json.dumps(problems))
"""


def test_every_bench_script_imports_what_exists_and_prints_its_usage():
    assert len(SCRIPTS) >= 10, SCRIPTS
    run = subprocess.run([sys.executable, "-c", CHECK, str(REPO), *map(str, SCRIPTS)], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    problems = json.loads(run.stdout.strip().splitlines()[-1])
    assert not problems, json.dumps(problems, indent=1)


def test_no_bench_script_edits_its_import_path():
    editing = [script.name for script in SCRIPTS if "sys.path" in script.read_text()]
    assert not editing, editing


def test_nearest_rank_is_one_of_the_samples():
    samples = [5.0, 1.0, 4.0, 2.0, 3.0]  # (unsorted on purpose)
    assert [stats.nearest_rank(samples, q) for q in (0, 20, 21, 50, 95, 100)] == [1.0, 1.0, 2.0, 3.0, 5.0, 5.0]
    # q * n / 100 an odd whole number: the rank itself, not one above it
    assert stats.nearest_rank(range(1, 21), 95) == 19
    assert math.isnan(stats.nearest_rank([], 50))


def test_quantile_summary_interpolates_and_has_none_for_no_samples():
    assert stats.quantile_summary(range(1, 102)) == {"p50": 51.0, "p95": 96.0, "p99": 100.0, "mean": 51.0}
    assert stats.quantile_summary([2.5]) == {"p50": 2.5, "p95": 2.5, "p99": 2.5, "mean": 2.5}
    assert stats.quantile_summary([]) == {"p50": None, "p95": None, "p99": None, "mean": None}


def test_markdown_table_aligns_and_refuses_ragged_rows():
    assert report.markdown_table(("name", "tok/s"), [("a", "1.0"), ("b", 2)], "lr") == (
        "| name | tok/s |\n|---|---:|\n| a | 1.0 |\n| b | 2 |")
    with pytest.raises(ValueError, match="2 columns"):
        report.markdown_table(("name", "tok/s"), [("a",)])
    with pytest.raises(ValueError, match="align"):
        report.markdown_table(("name", "tok/s"), [], "lx")


def test_results_path_is_the_given_one_or_a_stamped_file_under_bench_results(tmp_path):
    assert report.results_path("x", tmp_path / "given.json") == tmp_path / "given.json"
    default = report.results_path("serving")
    assert default.parent == Path(__file__).resolve().parent.parent / "bench" / "results"
    assert default.name.startswith("serving-") and default.suffix == ".json"
    written = report.write_json(tmp_path / "deeper" / "doc.json", {"a": [1, 2]})
    assert json.loads(written.read_text()) == {"a": [1, 2]}
