"""lm-eval (EleutherAI's evaluation harness) against `llm_api serve`, through its default path for an
OpenAI-compatible server: ``local-completions`` with the tokenizer detected on the server (``/tokenizer_info``
and ``/tokenize``, ``tokenizer_backend=auto``), prompts sent as token-id lists, several per call, scored with
``echo`` + ``logprobs``. The task is our own multiple-choice task (a few questions in a local JSON file, no
hub): its accuracy and every choice's loglikelihood must equal lm-eval's own ``hf`` run of the same float32
model in this process."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.server
lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Berlin"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("The largest planet in the solar system is", [" Mars", " Jupiter", " Venus"], 1),
    ("One plus one equals", [" three", " five", " two"], 2),
    ("The opposite of hot is", [" cold", " warm", " red"], 0),
    ("A week has seven", [" days", " cars", " songs"], 0),
]
TASK = "llm_api_facts"


@pytest.fixture
def task_folder(tmp_path):
    data = tmp_path / "facts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\n")
    return tmp_path


def _evaluate(model: str, model_args: dict, task_folder):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # Our one task only: indexing lm-eval's thousands of built-in task files took ~15 s per evaluation here.
    tasks = TaskManager(include_path=str(task_folder), include_defaults=False)
    results = simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                              task_manager=tasks, log_samples=True,
                              apply_chat_template=False)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return results["results"][TASK]["acc,none"], [[r[0][0] for r in s["resps"]] for s in samples]


def test_lm_eval_loglikelihood_through_local_completions_equals_hf(standalone_server, embedded_checkpoint_path,
                                                                   task_folder, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", standalone_server.key())  # (local-completions' Authorization header)
    served_acc, served = _evaluate("local-completions", {
        "base_url": f"{standalone_server.openai_base}/completions", "model": "smollm2", "batch_size": 4,
        "auth_token": standalone_server.key(), "max_retries": 1, "num_concurrent": 1,
    }, task_folder)
    hf_acc, local = _evaluate("hf", {"pretrained": str(embedded_checkpoint_path), "dtype": "float32", "batch_size": 4,
                                        "device": "cpu"},
                              task_folder)
    assert served_acc == hf_acc
    assert served_acc >= 0.5  # (the embedded model knows most of these: a broken scorer would not)
    # (The server serves the GGUF file, whose products quantize their inputs; hf runs the same weights in float32:
    # loglikelihoods within 1e-2, the decisions equal.)
    for served_row, local_row in zip(served, local, strict=True):
        assert all(math.isclose(a, b, abs_tol=1e-2) for a, b in zip(served_row, local_row, strict=True)), \
            (served_row, local_row)
