"""The repository routes over HTTP: the bearer token and the body, against a stand-in repository."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from orchestrator.control.errors import RepositoryError
from orchestrator.frontdoor.core import Core
from orchestrator.frontdoor.http_server import make_app
from orchestrator.frontdoor.repository_api import authorized

TOKEN = "t" * 24


class FakeRepository:
    """Records what it is asked and answers at once (the node's loop is not part of these tests)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.fail: RepositoryError | None = None

    def submit(self, kind: str, name: str, entry: Any = None) -> concurrent.futures.Future:
        self.calls.append((kind, name, entry))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.fail is not None:
            fut.set_exception(self.fail)
        else:
            fut.set_result({"name": name, "kind": kind, "message": "ok"})
        return fut


def test_authorized_compares_the_bearer_token() -> None:
    assert authorized(None, None) and authorized("anything", None)
    assert authorized(f"Bearer {TOKEN}", TOKEN)
    assert not authorized(None, TOKEN)
    assert not authorized(TOKEN, TOKEN)  # no scheme
    assert not authorized(f"Bearer {TOKEN}x", TOKEN)
    assert not authorized("Basic dXNlcjpwYXNz", TOKEN)


@pytest.fixture
def repo() -> FakeRepository:
    return FakeRepository()


async def _client(repo: FakeRepository) -> TestClient:
    app: web.Application = make_app(Core([], client=None), repo, TOKEN)  # type: ignore[arg-type]
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


def _run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


@pytest.fixture
def call(repo: FakeRepository) -> Iterator[Any]:
    def go(path: str, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None) -> tuple[int, Any]:
        async def inner() -> tuple[int, Any]:
            client = await _client(repo)
            try:
                data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
                r = await client.post(path, data=data, headers=headers or {})
                return r.status, await r.json()
            finally:
                await client.close()
        return _run(inner())
    yield go


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_no_token_or_a_wrong_one_is_refused_before_anything_is_done(call: Any, repo: FakeRepository) -> None:
    assert call("/v2/repository/models/a/load", {"parameters": {"config": {}}})[0] == 401
    code, body = call("/v2/repository/models/a/unload", headers={"Authorization": "Bearer nope"})
    assert code == 401 and "Bearer" in body["error"]
    assert repo.calls == []


def test_the_config_goes_to_the_repository_as_an_object_or_a_json_string(call: Any, repo: FakeRepository) -> None:
    entry = {"model": "resnet18", "slo_ms": 50}
    assert call("/v2/repository/models/a/load", {"parameters": {"config": entry}}, AUTH) == \
        (200, {"name": "a", "kind": "load", "message": "ok"})
    assert call("/v2/repository/models/b/load", {"parameters": {"config": json.dumps(entry)}}, AUTH)[0] == 200
    assert call("/v2/repository/models/c/load", None, AUTH)[0] == 200
    assert call("/v2/repository/models/c/unload", None, AUTH)[0] == 200
    assert repo.calls == [("load", "a", entry), ("load", "b", entry), ("load", "c", None), ("unload", "c", None)]


@pytest.mark.parametrize(("raw", "message"), [
    (b"{", "not valid JSON"),
    (b"[1]", "must be a JSON object"),
    (b'{"parameters": 3}', "'parameters' must be a JSON object"),
    (b'{"parameters": {"file:config.pbtxt": "x"}}', "unknown load parameter"),
    (b'{"parameters": {"config": "{nope"}}', "parameters.config is a string but not JSON"),
])
def test_a_bad_load_body_is_a_400_naming_what_is_wrong(call: Any, repo: FakeRepository, raw: bytes,
                                                      message: str) -> None:
    code, body = call("/v2/repository/models/a/load", headers=AUTH, raw=raw)
    assert code == 400 and message in body["error"]
    assert repo.calls == []


def test_a_repository_error_keeps_its_kind(call: Any, repo: FakeRepository) -> None:
    repo.fail = RepositoryError("not_found", "no app named 'a' is loaded")
    assert call("/v2/repository/models/a/unload", headers=AUTH) == (404, {"error": "no app named 'a' is loaded"})
    repo.fail = RepositoryError("unavailable", "the node is stopping")
    assert call("/v2/repository/models/a/load", {"parameters": {"config": {}}}, AUTH)[0] == 503
