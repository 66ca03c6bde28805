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


# -------------------------------------------------------------------------------------------------------
# the llama.cpp side by side's options (bench/peer_llamacpp.py --formats, bench/perplexity.py): parsed in a
# child as the scripts parse them, with no llama.cpp build (a build-info of empty files stands in)

OPTIONS = r"""
import contextlib, io, json, runpy, sys
from pathlib import Path

repo, tmp = Path(sys.argv[1]), Path(sys.argv[2])
sys.path[:0] = [str(repo), str(repo / "bench")]
peer = runpy.run_path(str(repo / "bench" / "peer_llamacpp.py"), run_name="peer_llamacpp_options")
ppl = runpy.run_path(str(repo / "bench" / "perplexity.py"), run_name="perplexity_options")
info = {}
for key in ("gguf_f32", "gguf_bf16", "gguf_q4_1", "gguf_q8_0", "gguf_q4_k_m", "gguf_1b_q4_k_m"):
    info[key] = str(tmp / (key + ".gguf"))
    Path(info[key]).write_bytes(b"")
out = {}

def refusal(parse, argv):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse(argv)
    except SystemExit as exit:
        return [exit.code, err.getvalue()[-300:]]
    return [0, ""]

def variants(argv):
    return [[v.name, v.gguf, v.env, v.format] for v in peer["variants"](info, peer["parse_args"](argv))]

out["default"] = variants([])
out["formats"] = variants(["--dtypes", "", "--formats", "q4_1,1b_q4_k_m"])
out["both"] = variants(["--dtypes", "float32", "--formats", "q4_k_m", "--dtype-for-formats", "bfloat16"])
out["missing_1b"] = refusal(lambda argv: peer["variants"]({}, peer["parse_args"](argv)), ["--dtypes", "", "--formats", "1b_q4_k_m"])
for name, argv in {"unknown_format": ["--formats", "q4_2"], "nothing": ["--dtypes", ""],
                   "bad_dtype": ["--formats", "q4_1", "--dtype-for-formats", "float16"]}.items():
    out[name] = refusal(peer["parse_args"], argv)
for name, argv in {"ppl_odd_ctx": ["--ctx", "511"], "ppl_parts": ["--parts", "llamacpp,vllm"],
                   "ppl_format": ["--format", "q4_2"]}.items():
    out[name] = refusal(ppl["parse_args"], argv)
args = ppl["parse_args"](["--format", "q8_0", "--model", "embedded", "--chunks", "4"])
out["ppl_env"] = ppl["llm_api_env"](info["gguf_q8_0"], args, 90000)
out["ppl_default_env"] = ppl["llm_api_env"](info["gguf_q8_0"], ppl["parse_args"]([]), 90000)
text, origin = ppl["load_text"](ppl["parse_args"]([]))
out["text"] = [len(text.encode()), origin["topics"], origin["sha256"] == ppl["sha256"](text.encode())]
print(json.dumps(out))
"""


def test_peer_llamacpp_formats_and_perplexity_options_parse_as_documented(tmp_path):
    run = subprocess.run([sys.executable, "-c", OPTIONS, str(REPO), str(tmp_path)], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    f32, bf16 = str(tmp_path / "gguf_f32.gguf"), str(tmp_path / "gguf_bf16.gguf")
    assert out["default"] == [["float32", f32, {"DTYPE": "float32"}, None],
                              ["bfloat16", bf16, {"DTYPE": "bfloat16"}, None]]  # the float runs stay the default
    q4_1, one_b = str(tmp_path / "gguf_q4_1.gguf"), str(tmp_path / "gguf_1b_q4_k_m.gguf")
    # a format: the same file to both, llm_api's DTYPE unset (None) unless --dtype-for-formats
    assert out["formats"] == [["gguf_q4_1.gguf", q4_1, {"MODEL_PATH": q4_1, "DTYPE": None}, "q4_1"],
                              ["gguf_1b_q4_k_m.gguf", one_b, {"MODEL_PATH": one_b, "DTYPE": None}, "1b_q4_k_m"]]
    q4_k_m = str(tmp_path / "gguf_q4_k_m.gguf")
    assert out["both"] == [["float32", f32, {"DTYPE": "float32"}, None],
                           ["gguf_q4_k_m.gguf", q4_k_m, {"MODEL_PATH": q4_k_m, "DTYPE": "bfloat16"}, "q4_k_m"]]
    assert out["missing_1b"][0] == "build-info.txt has no gguf_1b_q4_k_m (the 1b_q4_k_m GGUF file): run BUILD_1B=1 " \
                                   "scripts/build_llamacpp.sh"
    for name, fragment in {"unknown_format": "q4_2 not among q4_1, q8_0, q4_k_m, 1b_q4_k_m",
                           "nothing": "nothing to measure", "bad_dtype": "invalid choice: 'float16'",
                           "ppl_odd_ctx": "an even number", "ppl_parts": "a comma list of llamacpp, llm_api",
                           "ppl_format": "invalid choice: 'q4_2'"}.items():
        assert out[name][0] == 2 and fragment in out[name][1], (name, out[name])
    assert out["ppl_env"]["MODEL_PATH"] is None and out["ppl_env"]["DTYPE"] is None  # --model embedded: unset
    assert out["ppl_default_env"]["MODEL_PATH"] == str(tmp_path / "gguf_q8_0.gguf")  # default: the GGUF file itself
    assert out["ppl_default_env"]["MAX_INPUT_TOKENS"] == "90001"  # /tokenize takes the whole text
    size, topics, hashed = out["text"]
    assert 60_000 <= size <= 110_000 and topics and hashed, out["text"]


def test_llama_perplexity_method_on_known_inputs():
    from bench.harness import ppl

    tokens = list(range(10))
    assert ppl.chunks(tokens, 4, 16) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # whole chunks only, at most --chunks
    assert ppl.chunks(tokens, 4, 1, bos=99) == [[99, 1, 2, 3]]  # BOS replaces each chunk's first token
    assert ppl.chunks(tokens, 4, -1) == ppl.chunks(tokens, 4, 2)
    with pytest.raises(ValueError, match="at least 12"):
        ppl.chunks(tokens, 6, 1)  # llama-perplexity wants two chunks' worth of tokens
    # the second half only, each position predicted from all before it: n_ctx - n_ctx // 2 - 1 of them
    assert ppl.scored([None, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0], 8) == [-5.0, -6.0, -7.0]
    with pytest.raises(ValueError, match="7 logprobs"):
        ppl.scored([None] + [-1.0] * 6, 8)
    value, plus_minus = ppl.estimate([-1.0, -3.0])  # mean NLL 2, variance 1: se 1 -> +/- e^2
    assert value == pytest.approx(math.exp(2)) and plus_minus == pytest.approx(math.exp(2))
    assert ppl.estimate([-math.log(2)] * 4)[0] == pytest.approx(2.0)


def test_build_llamacpp_records_every_file_the_benchmarks_read(tmp_path):
    from bench.harness import llamacpp

    script = (REPO / "scripts" / "build_llamacpp.sh").read_text()
    for key in ["llama_bench", "llama_server", "llama_quantize", "llama_perplexity",
                *llamacpp.FORMATS.values(), *llamacpp.FLOAT_FORMATS.values()]:
        assert f"{key}=" in script, key
    (tmp_path / "build-info.txt").write_text("# a comment = not a key\nllama_cpp_commit=0c1e570\ngguf_q4_1=/x=y.gguf\n")
    assert llamacpp.build_info(tmp_path) == {"llama_cpp_commit": "0c1e570", "gguf_q4_1": "/x=y.gguf"}
    with pytest.raises(SystemExit, match="run scripts/build_llamacpp.sh"):
        llamacpp.build_info(tmp_path / "none")
