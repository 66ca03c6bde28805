"""The checkpoint's file mapping after start-up (llm_api.model.host_memory.release_unreferenced_file_pages): the
pages that the engine's merged copies replaced leave the resident set, the weights still read from the file
stay, and the answers do not change.

The embedded model's float32 checkpoint, loaded in its own dtype (transformers then maps the safetensors file
and each weight is a view of its pages): q/k/v and gate/up are merged into new memory by the engine, so about
half of the file is no longer any weight's.
"""

from __future__ import annotations

import asyncio
import logging
import mmap

import pytest
import torch

from llm_api.model.host_memory import _dead_pages, _file_mappings, _live_ranges, release_unreferenced_file_pages

PAGE = 4096
MIB = 1 << 20


def test_dead_pages_keep_every_page_a_live_range_touches():
    live = [(5000, 9000), (20000, 20001), (40000, 50000)]  # (the last outside the mapping)
    assert _dead_pages(0, 32768, live, PAGE) == [(0, 4096), (12288, 16384), (20480, 32768)]
    assert _dead_pages(0, 8192, [(0, 8192)], PAGE) == []
    assert _dead_pages(4096, 8192, [], PAGE) == [(4096, 8192)]


def _model_mappings(model: torch.nn.Module) -> list[tuple[int, int]]:
    live = _live_ranges(model)
    return [(start, end) for start, end in _file_mappings((".safetensors",))
            if any(low < end and high > start for low, high in live)]


def _resident(ranges: list[tuple[int, int]]) -> int:
    """Bytes of this process's resident pages in the mappings that start at one of ``ranges``' starts."""
    starts, total, counting = {start for start, _ in ranges}, 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                counting = int(head.split("-")[0], 16) in starts
            elif counting and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def _live_bytes(model: torch.nn.Module, ranges: list[tuple[int, int]]) -> int:
    return sum(min(high, end) - max(low, start) for low, high in _live_ranges(model) for start, end in ranges
               if low < end and high > start)


@pytest.fixture
def float_checkpoint_settings(embedded_checkpoint_path, monkeypatch):
    """The embedded float32 checkpoint, loaded by transformers (whose from_pretrained maps the safetensors file:
    what the release is for). Our own reader of the families' checkpoints (llm_api.model.checkpoint_model) copies
    the tensors out of the file and maps nothing; it is set aside here, as for a family that is not ours."""
    from llm_api.model import loader
    from llm_api.model.settings import Settings

    monkeypatch.setattr(loader, "checkpoint_config", lambda path: (None, "transformers' loading under test"))

    settings = Settings.from_env({"MODEL_PATH": str(embedded_checkpoint_path), "DTYPE": "float32",
                                  "KV_CACHE_MEMORY_MIB": "16"})
    if next(embedded_checkpoint_path.glob("*.safetensors"), None) is None:
        pytest.skip("the checkpoint has no safetensors file")
    return settings


def test_without_the_release_the_originals_stay_resident_and_with_it_the_tokens_do_not_change(
        float_checkpoint_settings):
    """The function itself, on an engine built as the service builds it: the merged originals' pages are resident
    after a few steps (what the release is for), gone after it, and the next greedy tokens are the same."""
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.engine.sampling_params import SamplingParams
    from llm_api.model import loader

    settings = float_checkpoint_settings
    lm = loader.load(settings)
    engine = LLMEngine(lm.model, EngineConfig.from_settings(settings), set(lm.eos_token_ids))
    prompt = lm.tokenizer.encode("The capital of France is")

    def greedy(request_id: str) -> list[int]:
        engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=12, do_sample=False, ignore_eos=True))
        tokens, finished = [], False
        while not finished:
            for output in engine.step():
                tokens += output.new_token_ids
                finished = finished or output.finished
        return tokens

    before = greedy("before")
    mappings = _model_mappings(lm.model)
    live, slack = _live_bytes(lm.model, mappings), 2 * mmap.PAGESIZE * len(_live_ranges(lm.model))
    assert _resident(mappings) > live + 100 * MIB, (_resident(mappings), live)
    released = release_unreferenced_file_pages(lm.model)
    assert released >= sum(end - start for start, end in mappings) - live - slack
    assert _resident(mappings) <= live + slack, (_resident(mappings), live)
    assert greedy("after") == before
    assert _resident(mappings) <= live + slack  # (nothing read the released pages back)


def test_the_merged_weights_originals_leave_the_resident_set_and_the_answers_stay(float_checkpoint_settings, caplog):
    """ModelService.load (both front ends' start-up) releases them: the file's pages left resident are the live
    weights' (plus the pages they share at their ends), and the service answers as generate() does."""
    from llm_api.model import loader
    from llm_api.protocols.native.translate import parse_request
    from llm_api.service.events import TextDelta
    from llm_api.service.service import ModelService

    settings = float_checkpoint_settings
    reference = loader.load(settings)  # (the same file, its own mapping: not the service's to release)
    reference_mappings = _model_mappings(reference.model)
    with caplog.at_level(logging.INFO, logger="llm_api.model.host_memory"):
        service = ModelService.load(settings)
    try:
        model = service.lm.model
        mappings = _model_mappings(model)
        assert mappings, "the float32 checkpoint is not mapped: transformers copied it (nothing to release)"
        assert not set(mappings) & set(reference_mappings)
        live, size = _live_bytes(model, mappings), sum(end - start for start, end in mappings)
        slack = 2 * mmap.PAGESIZE * len(_live_ranges(model))
        # (the engine merged q/k/v and gate/up: about half the file is no longer any weight's)
        assert live < 0.6 * size, (live, size)
        assert _resident(mappings) <= live + slack, (_resident(mappings), live)
        released = [record.getMessage() for record in caplog.records if "released" in record.getMessage()]
        assert len(released) == 1 and int(released[0].split()[1]) >= (size - live - slack) // MIB, (released, size, live)

        async def answer(request_id):
            request = parse_request({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                     "max_new_tokens": 24}, service.limits)
            return "".join(e.text for e in [e async for e in service.generate(request, request_id)]
                           if isinstance(e, TextDelta))

        served = asyncio.run(answer("after-release"))
    finally:
        service.shutdown()
    tokenizer = service.lm.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        expected = reference.model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=24, do_sample=False)[0, len(prompt):]
    assert served == tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in served
