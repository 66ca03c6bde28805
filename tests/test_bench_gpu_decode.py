"""bench/gpu_decode.py end to end in its CPU smoke mode (tiny fp32 Llama, batches 1 and 2, no compile).

The GPU run happens on a lent machine; this keeps the script from rotting between those runs: it must
run, measure every part (bandwidth, engine decode and prefill, generate(), the roofline, CUDA graphs on
and off) with positive numbers, and write the JSON the docs and the GPU session read.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "bench" / "gpu_decode.py"


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_engine(measurement: dict, batch_size: int) -> None:
    assert measurement["status"] == "ok", measurement
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s", "decode_seconds", "prefill_seconds"):
        assert _positive(measurement[key]), (key, measurement)
    assert measurement["decode_steps"] == 32 and measurement["prefill_steps"] >= 1
    assert measurement["num_preemptions"] == 0
    assert measurement["config"]["max_num_seqs"] == batch_size
    assert "cuda_graph_batch_sizes" in measurement


def test_smoke_run_writes_complete_results(tmp_path):
    out = tmp_path / "gpu_decode.json"
    completed = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "engine tok/s" in completed.stdout  # the table was printed
    doc = json.loads(out.read_text())

    assert doc["smoke"] is True and doc["complete"] is True
    env = doc["environment"]
    for key in ("device", "torch", "transformers", "date"):
        assert env[key], key
    assert doc["settings"]["batch_sizes"] == [1, 2] and doc["settings"]["context_len"] == 32
    bandwidth = doc["bandwidth"]
    assert _positive(bandwidth["best_bytes_per_s"])
    assert bandwidth["bytes_moved_per_copy"] == 2 * bandwidth["buffer_bytes"]

    model = doc["models"]["tiny-llama"]
    assert model["status"] == "ok"
    assert model["num_layers"] == 2 and model["num_kv_heads"] == 2 and model["vocab_size"] == 1000
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x head_dim x fp32
    assert 0 < model["weight_bytes_read_per_step"] <= model["weight_bytes"]

    assert [(r["model"], r["batch_size"]) for r in doc["rows"]] == [("tiny-llama", 1), ("tiny-llama", 2)]
    for row in doc["rows"]:
        batch_size = row["batch_size"]
        _check_engine(row["engine"], batch_size)
        generate = row["generate"]
        assert generate["status"] == "ok", generate
        assert generate["cache"] == "DynamicCache" and generate["attn_implementation"] == "sdpa"
        for key in ("decode_tokens_per_s", "prefill_tokens_per_s", "prefill_seconds", "total_seconds"):
            assert _positive(generate[key]), (key, generate)
        assert generate["total_seconds"] > generate["prefill_seconds"]
        assert row["static_compile"]["status"] == "skipped" and row["static_compile"]["reason"]
        roofline = row["roofline"]
        assert _positive(roofline["tokens_per_s"]) and _positive(roofline["kv_bytes_read"])
        # tokens/s <= B x bandwidth / (weight bytes + KV bytes read per step)
        expected = batch_size * bandwidth["best_bytes_per_s"] / (roofline["weight_bytes_read"]
                                                                 + roofline["kv_bytes_read"])
        assert math.isclose(roofline["tokens_per_s"], expected, rel_tol=1e-9)
        assert math.isclose(row["engine_fraction_of_roofline"],
                            row["engine"]["decode_tokens_per_s"] / roofline["tokens_per_s"], rel_tol=1e-9)
        assert math.isclose(row["engine_over_generate"],
                            row["engine"]["decode_tokens_per_s"] / generate["decode_tokens_per_s"], rel_tol=1e-9)
        assert row["engine_over_static_compile"] is None

    graphs = doc["cuda_graphs"]
    assert graphs["model"] == "tiny-llama" and graphs["batch_size"] == 1
    _check_engine(graphs["on"], 1)
    _check_engine(graphs["off"], 1)
    assert graphs["on"]["config"]["cuda_graphs"] is True and graphs["off"]["config"]["cuda_graphs"] is False
    assert _positive(graphs["speedup"])
    assert _positive(doc["elapsed_seconds"])
