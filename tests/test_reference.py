"""The generate() reference path: per-row parameters in one batch, per-row stops and aborts."""

import torch

from llm_api.engine.reference import ReferenceCore
from llm_api.engine.reference import ReferenceRequest as GenerationJob
from llm_api.engine.sampling_params import SamplingParams


def run(lm, jobs, abort_after=None):
    gen = ReferenceCore(lm.model, lm.eos_token_ids, lm.tokenizer.pad_token_id)
    tokens = {j.request_id: [] for j in jobs}
    reasons = {}

    def on_step(outputs):
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in reasons, "a job finished twice"
                reasons[out.request_id] = out.finish_reason
            if abort_after and out.request_id == abort_after[0] and len(tokens[out.request_id]) == abort_after[1]:
                gen.abort_request(out.request_id)

    for job in jobs:
        gen.add_request(job.request_id, job.prompt_token_ids, job.params)
    while gen.has_unfinished_requests():
        gen.run_step(on_step)
    return tokens, reasons


def ids(lm, text):
    return lm.tokenizer(text)["input_ids"]


def test_mixed_batch_rows_behave_as_alone(embedded_lm_fp32):
    lm = embedded_lm_fp32
    greedy = GenerationJob("g", SamplingParams(max_new_tokens=12), ids(lm, "The capital of France is"))
    seeded = GenerationJob("s", SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.9, seed=5), ids(lm, "My cat"))
    short = GenerationJob("short", SamplingParams(max_new_tokens=3), ids(lm, "Hello"))
    tokens, reasons = run(lm, [greedy, seeded, short])
    assert reasons == {"g": "length", "s": "length", "short": "length"} or reasons["g"] == "stop"
    assert len(tokens["short"]) == 3 and len(tokens["s"]) <= 10
    solo, _ = run(lm, [GenerationJob("s", seeded.params, seeded.prompt_token_ids)])
    assert solo["s"] == tokens["s"]  # a seeded row draws the same tokens whatever shares its batch
    ref = lm.model.generate(torch.tensor([greedy.prompt_token_ids]), max_new_tokens=12, do_sample=False)
    assert tokens["g"] == ref[0, len(greedy.prompt_token_ids):].tolist()[: len(tokens["g"])]


def test_eos_and_abort_end_rows(embedded_lm_fp32):
    lm = embedded_lm_fp32
    chat = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    jobs = [GenerationJob("eos", SamplingParams(max_new_tokens=40), chat),
            GenerationJob("cut", SamplingParams(max_new_tokens=40), ids(lm, "Once upon a time"))]
    tokens, reasons = run(lm, jobs, abort_after=("cut", 4))
    assert reasons == {"eos": "stop", "cut": "abort"}
    assert tokens["eos"][-1] in lm.eos_token_ids and len(tokens["cut"]) == 4
