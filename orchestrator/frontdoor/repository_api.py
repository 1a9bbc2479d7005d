"""The OIP model-repository extension's load and unload over HTTP, as Triton serves them.

- ``POST /v2/repository/models/<name>/load`` with ``{"parameters": {"config": <app entry>}}``: the
  app entry is apps.yaml's (a JSON object, or a JSON string of one, as Triton's ``config`` parameter
  is); no config loads what is already loaded (a no-op).
- ``POST /v2/repository/models/<name>/unload``.

Both wait for the node to finish the operation (orchestrator/node/repository.py) and answer 200 with
``{"name", "kind", "message"}``, or an error with its code. They need ``Authorization: Bearer
<token>`` when the node has a token (compared in constant time); a missing or wrong one gets 401
before the body is read. ``POST /v2/repository/index`` stays in http_server.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
from typing import Any, Protocol

from aiohttp import web

from orchestrator.control.errors import RepositoryError
from orchestrator.frontdoor.core import OipError

#: How long a load or unload call waits for the node (a load starts processes and loads a model).
CALL_TIMEOUT_S = 600.0
#: Largest request body of a load (an app entry is a few hundred bytes).
MAX_LOAD_BYTES = 1 << 20

class Repository(Protocol):
    """What the routes ask of the node's model repository (:class:`orchestrator.node.repository.Repository`)."""

    def submit(self, kind: str, name: str, entry: Any = None) -> concurrent.futures.Future[dict[str, Any]]:
        """Queue a ``load`` or ``unload``; the future fails with :class:`RepositoryError`."""
        ...


REPO_KEY: web.AppKey[Any] = web.AppKey("repository", object)
TOKEN_KEY: web.AppKey[Any] = web.AppKey("repository_token", object)


def authorized(header: str | None, token: str | None) -> bool:
    """True when ``token`` is None (no token configured) or ``header`` is ``Bearer <token>``; the
    comparison takes the same time wherever the two differ."""
    if token is None:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())


def _check_auth(request: web.Request) -> None:
    if not authorized(request.headers.get("Authorization"), request.app[TOKEN_KEY]):
        raise OipError("unauthenticated", "the model repository API needs 'Authorization: Bearer <token>' "
                                          "(node.repository.token_file / token_env)")


async def _config_of(request: web.Request) -> Any:
    if request.content_length is not None and request.content_length > MAX_LOAD_BYTES:
        raise OipError("invalid", f"a load body may be at most {MAX_LOAD_BYTES} bytes")
    body = await request.read()
    if not body.strip():
        return None
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OipError("invalid", f"load request is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise OipError("invalid", "load request must be a JSON object: {\"parameters\": {\"config\": {...}}}")
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise OipError("invalid", "'parameters' must be a JSON object")
    unknown = sorted(set(params) - {"config"})
    if unknown:
        raise OipError("invalid", f"unknown load parameter(s) {unknown}; the app's apps.yaml entry goes in "
                                  "parameters.config")
    config = params.get("config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise OipError("invalid", f"parameters.config is a string but not JSON: {e}") from None
    return config


async def _run(request: web.Request, kind: str, config: Any) -> web.Response:
    repo: Repository = request.app[REPO_KEY]
    name = request.match_info["name"]
    fut = repo.submit(kind, name, config)
    try:
        result = await asyncio.wait_for(asyncio.wrap_future(fut), CALL_TIMEOUT_S)
    except RepositoryError as e:
        raise OipError(e.kind, str(e)) from None
    except asyncio.TimeoutError:
        raise OipError("deadline", f"the {kind} of {name!r} did not end within {CALL_TIMEOUT_S:g} s; see "
                                   "the node's status") from None
    return web.json_response(result)


async def load(request: web.Request) -> web.Response:
    _check_auth(request)
    return await _run(request, "load", await _config_of(request))


async def unload(request: web.Request) -> web.Response:
    _check_auth(request)
    return await _run(request, "unload", None)


def add_repository_routes(app: web.Application, repository: Repository, token: str | None) -> None:
    """Register load and unload on ``app`` (before it starts)."""
    app[REPO_KEY] = repository
    app[TOKEN_KEY] = token
    app.router.add_post("/v2/repository/models/{name}/load", load)
    app.router.add_post("/v2/repository/models/{name}/unload", unload)
