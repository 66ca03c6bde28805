"""The route table (llm_api/protocols/table.py): how a request finds its route on each edge.

Unit tests of ``find`` over the shipped table and over a table with two methods on one path (what the
Responses API's retrieve and delete are): parameters, 404, 405, HEAD as GET, and TorchServe's missing
method (the override header, a JSON-accepting request taken as the GET, anything else refused rather
than guessed). The edges' behaviour over real servers is in the server tests."""

from __future__ import annotations

import pytest

from llm_api.errors import ApiError
from llm_api.protocols import table
from llm_api.protocols.route import Route, error_body


async def _unused(ctx, call, params):  # (never run: find only matches)
    raise AssertionError


TWO_METHODS = (Route("get_item", "GET", _unused, paths=("v1/items/{id}",), model_paths=("v1/items/{id}",)),
               Route("delete_item", "DELETE", _unused, paths=("v1/items/{id}",), model_paths=("v1/items/{id}",)),
               Route("create_item", "POST", _unused, paths=("v1/items",), model_paths=("v1/items",)))


def refusal(*args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as caught:
        table.find(*args, **kwargs)
    return caught.value


def test_each_edge_finds_the_shipped_routes():
    assert table.find("POST", "/predictions/smollm2", "server") == (table.BY_NAME["generate"], {"model": "smollm2"})
    assert table.find(None, "", "torchserve") == (table.BY_NAME["generate"], {})
    for edge, path in (("server", "/v1/chat/completions"), ("torchserve", "v1/chat/completions")):
        assert table.find("POST" if edge == "server" else None, path, edge)[0].name == "chat"
    assert table.find("GET", "/v1/health", "server")[0].name == "ready"
    assert table.find(None, "v1/health", "torchserve")[0].name == "ready"
    assert table.find("HEAD", "/health", "server")[0].name == "health"  # HEAD is served as GET


def test_unknown_paths_and_methods_are_refused_by_name():
    assert refusal("POST", "/v1/nothing", "server").status == 404
    assert refusal(None, "metrics", "torchserve").status == 404  # TorchServe serves its own metrics
    error = refusal("DELETE", "/v1/chat/completions", "server")
    assert error.status == 405 and "POST" in error.message
    hostile = refusal("GET", "/v1/" + "\r\n\x00é" * 1000, "server")
    assert hostile.status == 404 and len(hostile.message) < 300 and "\r" not in hostile.message


def test_the_error_shape_follows_the_path():
    assert table.error_shape("/predictions/x", "server") == "native"
    assert table.error_shape("/v1/x", "server") == table.error_shape("/x", "server") == "openai"
    assert table.error_shape("", "torchserve") == "native"
    assert table.error_shape("v1/x", "torchserve") == "openai"
    error = ApiError(400, "invalid_value", "bad")
    assert '"error"' in error_body("openai", error, "<|end|>") and '"error"' not in error_body("native", error, "")


def test_only_probes_are_public_and_metrics_where_opened():
    assert all(table.is_public(p) for p in ("/health", "/ready", "/v1/health"))
    assert not table.is_public("/metrics") and table.is_public("/metrics", metrics_public=True)  # (METRICS_PUBLIC)
    assert not any(table.is_public(p) for p in ("/v1/models", "/predictions/x", "/tokenize", "/nothing"))


def test_two_methods_on_one_path():
    assert table.find("GET", "/v1/items/7", "server", routes=TWO_METHODS) == (TWO_METHODS[0], {"id": "7"})
    assert table.find("DELETE", "/v1/items/7", "server", routes=TWO_METHODS)[0].name == "delete_item"
    assert refusal("PUT", "/v1/items/7", "server", routes=TWO_METHODS).status == 405


def test_torchserve_without_the_method_never_guesses_a_delete():
    find = table.find
    override = {"x-http-method-override": "DELETE", "accept": "application/json"}
    assert find(None, "v1/items/7", "torchserve", override, routes=TWO_METHODS)[0].name == "delete_item"
    assert find(None, "v1/items/7", "torchserve", {"x-http-method-override": "get"},
                routes=TWO_METHODS)[0].name == "get_item"
    assert find(None, "v1/items/7", "torchserve", {"accept": "application/json"}, routes=TWO_METHODS)[0].name == "get_item"
    for headers in ({}, {"accept": "*/*"}):  # (what a DELETE from the openai package sends)
        error = refusal(None, "v1/items/7", "torchserve", headers, routes=TWO_METHODS)
        assert error.status == 400 and error.code == "method_unknown" and "X-HTTP-Method-Override" in error.message
    assert refusal(None, "v1/items/7", "torchserve", {"x-http-method-override": "PATCH"},
                   routes=TWO_METHODS).status == 405
    # One route on a path needs no method at all.
    assert find(None, "v1/items", "torchserve", {}, routes=TWO_METHODS)[0].name == "create_item"
