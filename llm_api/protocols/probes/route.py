"""Probes and listings that never wait behind generation (they read snapshots):

* ``GET health``: liveness: the process serves and its engine thread lives (200 while the model loads);
* ``GET ready`` (TorchServe and the standalone server: ``v1/health`` too): readiness: model loaded,
  engine stepping, not draining (``llm_api.service.metrics.Health``);
* ``GET v1/models``: the served model and its LoRA adapters (OpenAI's list shape; an adapter's ``parent``
  is the base model, as vLLM lists them);
* ``GET metrics``: the Prometheus text of the edge that has one (the standalone server; TorchServe
  serves its own on the metrics port).

A probe's 503 carries ``Retry-After`` like every other 503.
"""

from __future__ import annotations

import json

from llm_api.errors import DEFAULT_RETRY_AFTER_S, ApiError
from llm_api.protocols.common.openai import models_list
from llm_api.protocols.route import Answer, Call, RouteContext, Whole


def _probe(ok: bool, answer: dict) -> Whole:
    return Whole(200 if ok else 503, json.dumps(answer), headers={} if ok else {"Retry-After": str(DEFAULT_RETRY_AFTER_S)})


async def health(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    alive = ctx.service is None or ctx.service.loop.alive
    return _probe(alive, {"status": "alive" if alive else "engine_stopped"})


async def ready(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    if ctx.service is None:
        return _probe(False, {"ready": False, "status": "loading"})
    answer = ctx.service.metrics.health().to_json()
    if ctx.draining:
        answer.update(ready=False, status="draining")
    return _probe(bool(answer["ready"]), answer)


async def models(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.loaded()
    return Whole(200, models_list(service.model_names, service.created, service.adapter_names()))


async def metrics(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    if ctx.metrics_text is None:
        raise ApiError(404, "not_found", "this front end serves no metrics here")
    text, content_type = ctx.metrics_text()
    return Whole(200, text, content_type)
