"""Every script in bench/ still starts: what it imports from llm_api (and from tests/, whose launchers several
borrow) exists, and ``--help`` prints its usage. The benchmarks run by hand, between changes that rename
modules; without this a script rots unseen (bench/grammar_overhead.py imported two modules that had been gone
for months, issue 35).

Both checks run in one child process, so torch and the package are imported once for all the scripts: the
imports are read from each script's syntax tree (function-level ones included, which ``--help`` never
reaches), then each script runs as ``__main__`` with ``--help`` and must exit 0 having printed a usage line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "bench").glob("*.py"))

CHECK = r"""
import ast, contextlib, importlib, io, json, runpy, sys
from pathlib import Path

repo = Path(sys.argv[1])
sys.path[:0] = [str(repo), str(repo / "tests"), str(repo / "bench")]
local = {p.stem for p in (repo / "tests").glob("*.py")} | {p.stem for p in (repo / "bench").glob("*.py")}
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
