"""OpenAI's embeddings API over the served model: a body becomes one request per input (``parse_embeddings``),
and the pooled states become OpenAI's answer (``embeddings_answer``). Contract:

* ``POST v1/embeddings``: ``model`` (the base model under any of its names, or a LoRA adapter), ``input``
  (a string, a list of strings, a list of token ids, or a list of such lists; at most ``MAX_INPUTS``, none
  empty, ids below the vocabulary size), ``encoding_format`` (``float``, or ``base64``: the float32 values
  little-endian, what the ``openai`` package asks for by default and decodes), ``dimensions`` (taken only
  at the model's hidden size: a causal LM's states cannot be shortened meaningfully), ``user``, and ours,
  ``pooling``: ``mean`` (the default) over the prompt's tokens or ``last`` (its last token's state).
* Each input is a prompt like a completion's (a string with the tokenizer's special tokens, as
  ``v1/completions`` tokenizes it; ids as they are), run through the engine's prefill: the last hidden
  state (after the final norm) at each of its tokens, pooled and normalized to length 1. No token is
  decoded for the answer (the engine samples one, which is dropped). The whole prompt is computed (no
  prefix-cache hits, as for prompt logprobs).
* The answer: ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage":
  {"prompt_tokens", "total_tokens"}}``, in the order of ``input``.
* A causal LM's hidden states are not trained as sentence embeddings (the embedded SmolLM2's are not):
  the route serves them as they are, for retrieval experiments and for clients that need the route; a
  model trained for embeddings (a decoder fine-tuned with last-token pooling) gets its use from ``last``.
* What one call may cost: at most ``MAX_INPUTS`` inputs and ``MAX_EMBEDDING_VALUES`` values in the answer
  (inputs x hidden size), and the inputs' work summed against MAX_REQUEST_WORK, as a completion's prompt list.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from pydantic import ValidationError

from llm_api.errors import ApiError
from llm_api.protocols.common.openai import api_error, check_model, decode_body
from llm_api.protocols.common.sampling import to_sampling_params
from llm_api.protocols.embeddings.schema import EmbeddingsBody
from llm_api.service.request import GenerateRequest, Limits, ModelNames, adapter_of

if TYPE_CHECKING:  # (the route table loads without torch; the answer is made where the engine runs)
    import torch

MAX_INPUTS = 2048  # OpenAI's limit on one call's inputs
MAX_EMBEDDING_VALUES = 1 << 21  # inputs x hidden size: ~40 MB of JSON at most


@dataclass
class EmbeddingsCall:
    requests: list[GenerateRequest]  # one per input, in order
    model: str  # the name asked (the answer names it)
    encoding_format: str


def parse_embeddings(body: Any, model_names: ModelNames, limits: Limits, adapters: Sequence[str] = ()
                     ) -> EmbeddingsCall:
    data = decode_body(body)
    try:
        call = EmbeddingsBody.model_validate(data)
    except ValidationError as error:
        raise api_error(error) from None
    check_model(call.model, model_names, adapters)
    inputs = _inputs(call.input, limits)
    if call.dimensions is not None and call.dimensions != limits.hidden_size:
        raise ApiError(400, "unsupported_value", f"'dimensions' can only be this model's hidden size, "
                       f"{limits.hidden_size} (a causal LM's states are not trained to be shortened)", "dimensions")
    if limits.hidden_size is not None and len(inputs) * limits.hidden_size > MAX_EMBEDDING_VALUES:
        most = MAX_EMBEDDING_VALUES // limits.hidden_size
        raise ApiError(400, "invalid_value", f"'input' has {len(inputs)} items; at most {most} fit one answer here "
                       f"({limits.hidden_size} values each): send them in several calls", "input")
    params = to_sampling_params(max_tokens=1, default_max_tokens=1, limits=limits, temperature=0.0,
                                pooling=call.pooling)
    requests = []
    for item in inputs:
        request = GenerateRequest(text=item if isinstance(item, str) else None,
                                  token_ids=item if isinstance(item, list) else None, params=params)
        request.adapter, request.adapter_param = adapter_of(call.model, model_names), "model"
        requests.append(request)
    return EmbeddingsCall(requests, call.model, call.encoding_format)


def _inputs(value: Any, limits: Limits) -> list[str | list[int]]:
    """``input`` as a list of prompts (a string, or a list of token ids), each checked."""
    if isinstance(value, str):
        items: list = [value]
    elif value and all(isinstance(x, int) for x in value):
        items = [value]  # one prompt as token ids
    else:
        items = list(value)
    if not items:
        raise ApiError(400, "invalid_value", "'input' must not be empty", "input")
    if len(items) > MAX_INPUTS:
        raise ApiError(400, "invalid_value", f"'input' has {len(items)} items; at most {MAX_INPUTS} are allowed",
                       "input")
    for i, item in enumerate(items):
        param = "input" if len(items) == 1 and not isinstance(value, list) else f"input[{i}]"
        if not item:
            raise ApiError(400, "invalid_value", f"{param!r} must not be empty", param)
        if isinstance(item, list) and limits.vocab_size is not None and \
                (min(item) < 0 or max(item) >= limits.vocab_size):
            raise ApiError(400, "invalid_value", f"{param!r} holds an id that is not a token id of this model (0 to "
                           f"{limits.vocab_size - 1})", param)
    return items


def embeddings_answer(call: EmbeddingsCall, vectors: list[torch.Tensor], num_prompt_tokens: int) -> str:
    """The pooled states (in input order) -> OpenAI's answer: each normalized to length 1."""
    import torch  # (only where the engine runs: torch is loaded there already)

    data = []
    for i, vector in enumerate(vectors):
        unit = torch.nn.functional.normalize(vector.float(), dim=0)
        if call.encoding_format == "base64":
            value: Any = base64.b64encode(unit.numpy().astype("<f4").tobytes()).decode("ascii")
        else:
            value = unit.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return json.dumps({"object": "list", "data": data, "model": call.model,
                       "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}})
