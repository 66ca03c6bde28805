"""OpenAI's embeddings API: the body's rules without a server, then the real ``openai`` package's
``embeddings.create`` and LangChain's ``OpenAIEmbeddings`` over both front ends, each vector checked against
the model run in this process (the decoder's last hidden state pooled over the prompt, normalized)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from llm_api.errors import ApiError
from llm_api.protocols.embeddings.translate import MAX_INPUTS, parse_embeddings
from llm_api.service.request import Limits

LIMITS = Limits(max_input_tokens=2048, max_new_tokens=256, hidden_size=576, vocab_size=49152)
TEXTS = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock prices fell sharply today."]


def _parse(**fields):
    return parse_embeddings(json.dumps({"model": "m", **fields}).encode(), "m", LIMITS)


def test_inputs_become_one_prefill_each():
    for value, prompts in (("hi", [("hi", None)]), (["a", "b"], [("a", None), ("b", None)]),
                           ([1, 2, 3], [(None, [1, 2, 3])]), ([[1], [2, 3]], [(None, [1]), (None, [2, 3])])):
        call = _parse(input=value)
        assert [(r.text, r.token_ids) for r in call.requests] == prompts
        assert all(r.params.pooling == "mean" and r.params.max_new_tokens == 1 and r.params.greedy
                   for r in call.requests)
    assert _parse(input="hi", pooling="last").requests[0].params.pooling == "last"
    assert _parse(input="hi", encoding_format="base64", dimensions=576, user="u").encoding_format == "base64"


@pytest.mark.parametrize("fields, code, param", [
    ({"input": ""}, "invalid_value", "input"),
    ({"input": []}, "invalid_value", "input"),
    ({"input": ["a", ""]}, "invalid_value", "input[1]"),
    ({"input": [[1], []]}, "invalid_value", "input[1]"),
    ({"input": [1, 49152]}, "invalid_value", "input[0]"),
    ({"input": [[-1]]}, "invalid_value", "input[0]"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "invalid_value", "input"),
    ({"input": "a", "dimensions": 64}, "unsupported_value", "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "invalid_value", "encoding_format"),
    ({"input": "a", "pooling": "cls"}, "invalid_value", "pooling"),
    ({"input": "a", "truncate": True}, "unknown_parameter", "truncate"),
    ({"input": 5}, "invalid_type", "*"),
    ({"input": [1.5]}, "*", "*"),
])
def test_bad_bodies_get_their_400(fields, code, param):
    with pytest.raises(ApiError) as refused:
        _parse(**fields)
    assert refused.value.status == 400
    assert code == "*" or refused.value.code == code, refused.value
    assert param == "*" or refused.value.param == param, refused.value


def test_the_answer_is_bounded_by_its_values():
    wide = Limits(max_input_tokens=2048, max_new_tokens=256, hidden_size=8192, vocab_size=49152)
    with pytest.raises(ApiError) as refused:
        parse_embeddings(json.dumps({"model": "m", "input": ["a"] * 300}).encode(), "m", wide)
    assert refused.value.param == "input" and "at most 256" in refused.value.message


# ------------------------------------------------------------------------------------------ served


def _reference(lm, texts: list[str], pooling: str = "mean") -> np.ndarray:
    """The model in this process: the decoder's last hidden state at each prompt token, pooled, normalized."""
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([lm.tokenizer.encode(text)])
            hidden = lm.model.get_decoder()(input_ids=ids).last_hidden_state[0].float()
            pooled = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
            rows.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return np.stack(rows)


@pytest.mark.server
def test_openai_embeddings_match_the_model(async_frontend, embedded_lm_fp32):
    import openai

    client = openai.OpenAI(base_url=async_frontend.openai_base, api_key=async_frontend.key(), max_retries=0)
    long_text = " ".join(f"Sentence number {i} talks about a different topic entirely." for i in range(40))
    texts = TEXTS + [long_text]  # (the long one is prefilled in several chunks on hosts with a small step budget)
    answer = client.embeddings.create(model=async_frontend.model_name, input=texts)  # (base64: the package's default)
    vectors = np.array([d.embedding for d in answer.data])
    expected = _reference(embedded_lm_fp32, texts)
    assert vectors.shape == expected.shape and [d.index for d in answer.data] == list(range(len(texts)))
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    assert np.all(np.sum(vectors * expected, axis=1) > 0.999), np.sum(vectors * expected, axis=1)
    similarity = vectors[:3] @ vectors[:3].T
    assert similarity[0, 1] > similarity[0, 2]  # (the two sentences about a cat are the closer pair)
    ids = embedded_lm_fp32.tokenizer.encode(TEXTS[0])
    assert answer.usage.prompt_tokens == sum(len(embedded_lm_fp32.tokenizer.encode(t)) for t in texts)

    floats = client.embeddings.create(model=async_frontend.model_name, input=TEXTS[0], encoding_format="float")
    by_ids = client.embeddings.create(model=async_frontend.model_name, input=ids, encoding_format="float")
    # (alone or beside others, a prompt's rows meet other kernels: float32 sums in another order, ~1e-5 apart)
    assert np.allclose(floats.data[0].embedding, vectors[0], atol=2e-4)
    assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=2e-4)
    last = client.embeddings.create(model=async_frontend.model_name, input=TEXTS[:2], extra_body={"pooling": "last"})
    assert np.all(np.sum(np.array([d.embedding for d in last.data]) * _reference(embedded_lm_fp32, TEXTS[:2], "last"),
                         axis=1) > 0.999)
    raw = client.embeddings.with_raw_response.create(model=async_frontend.model_name, input=TEXTS[0],
                                                     encoding_format="base64")
    encoded = json.loads(raw.text)["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(encoded), dtype="<f4"), floats.data[0].embedding, atol=2e-4)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=async_frontend.model_name, input="")


@pytest.mark.server
def test_langchain_embeds_documents_and_a_query(async_frontend):
    langchain_openai = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: LangChain would otherwise tokenize with tiktoken (OpenAI's vocabulary,
    # fetched from the internet) and send OpenAI's token ids; every non-OpenAI server needs this setting.
    embeddings = langchain_openai.OpenAIEmbeddings(model=async_frontend.model_name, base_url=async_frontend.openai_base,
                                                   api_key=async_frontend.key(), check_embedding_ctx_length=False,
                                                   max_retries=0)
    documents = embeddings.embed_documents(TEXTS)
    query = embeddings.embed_query(TEXTS[1])
    assert len(documents) == 3 and all(len(v) == 576 for v in documents)
    scores = np.array(documents) @ np.array(query)
    assert int(np.argmax(scores)) == 1 and scores[1] > 0.999


HOSTILE = {  # name -> the body (bytes, or the fields beside "model")
    "not json": b'{"model": ',
    "input null": {"input": None},
    "a nested list of strings": {"input": [["a"]]},
    "ids out of range": {"input": [[0, 10 ** 12]]},
    "a negative id": {"input": [-1]},
    "a float among ids": {"input": [1, 2.5]},
    "2,049 inputs": {"input": ["a"] * 2049},
    "an empty string among many": {"input": ["a"] * 100 + [""]},
    "a prompt over MAX_INPUT_TOKENS": {"input": "hello " * 5000},
    "ids over MAX_INPUT_TOKENS": {"input": [1] * 100_000},
    "a lone surrogate": b'{"model": "smollm2", "input": "a\\udc00"}',
    "NaN as input": b'{"model": "smollm2", "input": NaN}',
    "dimensions zero": {"input": "a", "dimensions": 0},
    "encoding_format raw": {"input": "a", "encoding_format": "raw"},
    "an unknown model": {"model": "text-embedding-3-small", "input": "a"},
}


@pytest.mark.server
def test_hostile_bodies_get_their_4xx_while_a_stream_runs(async_frontend):
    from bench.harness import hostile

    path = hostile.openai_path(async_frontend, "embeddings")
    problems, answers = [], {}
    with hostile.Witness(async_frontend) as witness:
        for name, value in HOSTILE.items():
            body = value if isinstance(value, bytes) else json.dumps({"model": async_frontend.model_name, **value}).encode()
            answer = hostile.post_json(async_frontend, path, body)
            answers[name] = answer.status
            problems += hostile.refusal_problems(name, answer, openai=True)
    hostile.report("embeddings", async_frontend, inputs=len(answers), answers=answers, witness=witness)
    assert not problems, "\n".join(problems)
