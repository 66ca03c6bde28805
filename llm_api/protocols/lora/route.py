"""Runtime LoRA adapter loading, vLLM's shapes: ``POST v1/load_lora_adapter`` and ``POST v1/unload_lora_adapter``.

Bodies: ``{"lora_name": name, "lora_path": path}`` and ``{"lora_name": name}``. Off unless
LORA_RUNTIME_LOADING=true (403 ``lora_runtime_loading_disabled``); a path must resolve, symlinks
included, inside LORA_ADAPTER_ROOT (400 ``invalid_lora_path``: nothing is downloaded); an adapter that does
not fit the model is 400 ``invalid_adapter`` naming why; unloading an adapter with live requests is 409
``adapter_in_use`` (retry once they finished), an unknown one 404 ``model_not_found``.

Who may call them: on the standalone server, any holder of its bearer key (as for every route). Under
TorchServe, the frontend checks the inference key in ``Authorization`` as for every path below the model;
changing what the server serves is management, so these routes also need TorchServe's management key in
``X-Management-Key`` (``RouteContext.management_key``: read from TorchServe's key file at each call, since
TorchServe rotates its keys); a missing or wrong one is 403 ``management_key_required``.
"""

from __future__ import annotations

import hmac
import json

from llm_api.errors import ApiError
from llm_api.protocols.common.validation import decode_json
from llm_api.protocols.route import Answer, Call, RouteContext, Whole

MAX_FIELD_CHARS = 4096
MANAGEMENT_KEY_HEADER = "x-management-key"


def _fields(call: Call, names: tuple[str, ...]) -> dict[str, str]:
    data = decode_json(call.json_body())
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object")
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ApiError(400, "invalid_parameter", f"unknown field {unknown[0]!r}", unknown[0][:64])
    values = {}
    for name in names:
        value = data.get(name)
        if not isinstance(value, str) or not value or len(value) > MAX_FIELD_CHARS:
            raise ApiError(400, "invalid_value", f"'{name}' must be a non-empty string", name)
        values[name] = value
    return values


def _check_management_key(ctx: RouteContext, call: Call) -> None:
    if ctx.management_key is None:
        return
    expected = ctx.management_key()
    if expected is None:
        return  # TorchServe runs without token auth: its own management API is open too
    given = call.headers.get(MANAGEMENT_KEY_HEADER, "")
    if not hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode()):
        raise ApiError(403, "management_key_required", f"loading and unloading adapters needs TorchServe's management "
                       f"key in the {MANAGEMENT_KEY_HEADER!r} header (key_file.json)")


async def load(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.serving()
    _check_management_key(ctx, call)
    fields = _fields(call, ("lora_name", "lora_path"))
    from llm_api.lora.config import AdapterError, check_adapter_name

    try:
        check_adapter_name(fields["lora_name"])
    except AdapterError:
        raise ApiError(400, "invalid_value", "'lora_name' must be 1-64 characters of A-Z a-z 0-9 . _ - "
                       "(a letter or digit first)", "lora_name") from None
    await service.load_adapter(fields["lora_name"], fields["lora_path"])
    return Whole(200, json.dumps({"status": "loaded", "lora_name": fields["lora_name"]}))


async def unload(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.loaded()
    _check_management_key(ctx, call)
    fields = _fields(call, ("lora_name",))
    service.unload_adapter(fields["lora_name"])
    return Whole(200, json.dumps({"status": "unloaded", "lora_name": fields["lora_name"]}))
