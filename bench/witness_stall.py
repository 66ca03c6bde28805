"""How long one hostile body stalls a running stream: the hostile suite's witness, run by run.

Starts a real front end (TorchServe in the shipped async mode, or `llm_api serve`) serving the embedded
model with the Hermes tool template of the tests (float32, a 64 MiB KV pool: the suite's hermes_server),
then, ``--runs`` times and one after another: a witness stream alone for 1.5 s (the baseline gap), and a
witness while a chat request with a tool schema of ``--props`` properties (66,000: the 5.8 MB schema of
``tests/test_hostile_tools.py``, near max_request_size) is sent and answered. Prints each run's longest
witness gap (``bench/harness/hostile.py``'s ``Witness``: chunk arrivals at the client, the gap still open at the
cancel included), the answer and its time, then min / median as JSON. ``--spy FILE`` records the worker's
GIL-holding stacks with py-spy (installed separately) while the runs go, in py-spy's raw format. Usage:

    python bench/witness_stall.py --front torchserve --runs 6
    python bench/witness_stall.py --front standalone --runs 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LLM_API_STALL_LIMIT_S", "1000")  # (measured here, not asserted: read when hostile is imported)

from harness import hostile  # noqa: E402
from harness.models import model_dir  # noqa: E402
from harness.standalone_server import StandaloneServer  # noqa: E402
from harness.torchserve_server import REPO, TorchServe  # noqa: E402


def hermes_model(folder: Path) -> Path:
    """The embedded model with the tests' Hermes tool template (links to its files)."""
    folder.mkdir(parents=True)
    for item in model_dir().iterdir():
        if item.name != "chat_template.jinja":
            (folder / item.name).symlink_to(item)
    (folder / "chat_template.jinja").write_text((REPO / "tests" / "assets" / "hermes_tools.jinja").read_text())
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--front", choices=("torchserve", "standalone"), default="torchserve")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--props", type=int, default=66_000, help="properties of the tool's schema (66,000: 5.8 MB)")
    parser.add_argument("--spy", type=Path, help="record the worker's GIL-holding stacks here (py-spy)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="witness-stall-"))
    env = {"MODEL_PATH": str(hermes_model(work / "model")), "KV_CACHE_MEMORY_MIB": "64", "DTYPE": "float32"}
    server = (TorchServe(work / "ts", model_config=(REPO / "model-config.yaml").read_text(), env=env)
              if args.front == "torchserve" else StandaloneServer(work / "standalone", env=env))
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                               for i in range(args.props)}}
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "What is the weather?"}],
            "max_tokens": 12, "temperature": 0, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "huge", "parameters": schema}}]}
    gaps, baselines, seconds = [], [], []
    spy = None
    try:
        server.start()  # (inside: a start that fails half-way is stopped too)
        path = hostile.openai_path(server, "chat/completions")
        if args.spy:
            program = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
            spy = subprocess.Popen([program or "py-spy", "record", "--gil", "--native", "-r", "200", "-f", "raw", "-o",
                                    str(args.spy), "--pid", str(server.worker_pid())],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2)
        for run in range(args.runs):
            with hostile.Witness(server) as witness:
                time.sleep(1.5)
            baselines.append(witness.max_gap)
            with hostile.Witness(server) as witness:
                time.sleep(0.3)
                start = time.monotonic()
                answer = hostile.post_json(server, path, body)
                seconds.append(time.monotonic() - start)
            gaps.append(witness.max_gap)
            print(f"run {run}: {answer.status} {answer.body[:100]!r} in {seconds[-1]:.2f} s; witness gap "
                  f"{gaps[-1]:.2f} s (alone: {baselines[-1]:.2f} s)", flush=True)
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"front": args.front, "body_bytes": len(json.dumps(body)), "gaps_s": [round(g, 2) for g in gaps],
                      "min_s": round(min(gaps), 2), "median_s": round(statistics.median(gaps), 2),
                      "alone_s": [round(g, 2) for g in baselines], "answer_s": [round(s, 2) for s in seconds]}))


if __name__ == "__main__":
    main()
