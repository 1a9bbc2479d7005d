"""Apps a node does not host, served by forwarding: a fleet's front door takes a request for any app.

In a fleet (docs/fleet.md) each app runs on one node (its primary) with a standby on another. A user
who speaks HTTP or gRPC to *any* node's front door should not need the routing table: with
``node.fleet_routes`` set (the agent sets it to its own routes server), the front door keeps the
fleet's routing table (``GET <seed>/fleet/routes``, refreshed every :data:`REFRESH_S`) and answers a
request for an app it does not host by sending its rows to the app's owner **over the wire format**,
as :class:`gpuprims.client.FleetClient` does: straight to the primary's UDP ingest, no other hop.

- The model's shape, dtype, batch and SLO come from the table (``route_model``: the controller puts
  them there), so the request is checked and decoded here as a hosted model's is, and refused
  before it leaves the node when it is not the model's. A model file's route carries its completed
  config.pbtxt (``file``: its named tensors, datatypes and dims), and its requests travel as
  multi-tensor bodies (docs/wire-format.md), as a hosted file model's do.
- No answer within :data:`FAILOVER_S`, or the app's SLO where that is longer (or the owner answers UNKNOWN_APP / INSTANCE_FAILED /
  SHUTTING_DOWN): the table is fetched again and the row sent again, under a new request id, to the
  new primary or the standby. Both stay open; the first usable answer is the row's, and any later
  one is dropped by the client (a stray), never answered twice. ``failovers`` counts the re-sends.
- A model the node hosts is never forwarded, whatever the table says.

Everything here runs on the front door's loop; nothing blocks it (the table is fetched with aiohttp).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import numpy as np

from gpuprims.client import FAILOVER_STATUSES, AsyncClient, RequestLost, Result
from gpuprims.modelrepo import ModelConfig
from gpuprims.tensorwire import decode
from gpuprims.wire import DType, Status
from orchestrator.config import model_files
from orchestrator.config.schema import AppConfig
from orchestrator.frontdoor.models import ModelInfo, model_info, output_dim
from orchestrator.frontdoor.transport import Marks

log = logging.getLogger("gpuprims.frontdoor")

#: How often the routing table is fetched again (and at once after a failover).
REFRESH_S = 1.0
#: How long a forwarded row waits for the owner before it is sent again to the standby.
FAILOVER_S = 0.5
#: How long one fetch of the table may take per seed.
FETCH_TIMEOUT_S = 1.0

Address = tuple[str, int]


def route_model(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What a front door needs to take requests of an app it does not host, from the app's apps.yaml
    entry with the node's defaults applied: its input shape and dtype, output size (-1 for a user
    model or a DAG: it is not built here), batch bound and wait, and SLO. A model file's (``model:
    path/to/model.onnx``, read here as the node reads it, or an entry with its ``file`` already) also
    carries ``file``: its completed config.pbtxt as JSON and its version."""
    entry = dict(entry)
    if entry.get("file") is None and isinstance(entry.get("model"), str) and model_files.is_model_file(entry["model"]):
        entry = model_files.file_app(entry, None)
    app = AppConfig.model_validate(entry)
    zoo = app.stages is None and app.model is not None and ":" not in app.model and app.file is None
    out = {"input_shape": list(app.input_shape), "dtype": app.dtype, "output_dim": output_dim(app) if zoo else -1,
           "max_batch": app.max_batch, "max_wait_ms": app.max_wait_ms, "slo_ms": app.slo_ms}
    if app.file is not None:
        out["file"] = {"config_json": app.file.config_json, "version": app.file.version}
    return out


def model_info_from_route(name: str, route: Mapping[str, Any]) -> ModelInfo | None:
    """The ModelInfo of a routed app, or None when its route carries no model (an older controller's)."""
    m = route.get("model")
    if not isinstance(m, Mapping):
        return None
    f = m.get("file")
    if f is not None:
        try:
            cfg = ModelConfig.from_json(str(f["config_json"]))
            version = int(f.get("version", 1))
            # The info a hosting node makes of the app (its config's tensors; requests bounded as the
            # node's default pool bounds them), under the routed app id, batch bound and SLO.
            app = AppConfig.model_validate({
                "name": name, "model": "/routed/model.onnx", "app_id": int(route["app_id"]),
                "max_batch": int(m["max_batch"]), "max_wait_ms": float(m["max_wait_ms"]),
                "slo_ms": float(m["slo_ms"]), "engine": "onnxruntime",
                "file": {"path": "/routed/model.onnx", "config_json": cfg.to_json(), "version": version}})
            return model_info(app)
        except Exception as e:  # a table this front door cannot read (a newer controller's): not forwarded
            log.warning("front door: the route of %s carries a model file config that does not read: %s", name, e)
            return None
    try:
        return ModelInfo(name=name, app_id=int(route["app_id"]), input_shape=tuple(int(d) for d in m["input_shape"]),
                         dtype=str(m["dtype"]), output_dim=int(m.get("output_dim", -1)),
                         max_batch=int(m["max_batch"]), max_wait_ms=float(m["max_wait_ms"]),
                         slo_ms=float(m["slo_ms"]), instances=0)
    except (KeyError, TypeError, ValueError):
        return None


def _address(target: Mapping[str, Any] | None) -> Address | None:
    if not target:
        return None
    return (str(target["host"]), int(target["udp_port"]))


class Forwarder:
    """The fleet's routing table on the front door's loop, and the rows of routed apps sent to their
    owners (module docstring). ``await open()`` starts the refresher; ``close()`` stops it."""

    name = "forward"

    def __init__(self, seeds: Sequence[str], *, refresh_s: float = REFRESH_S, failover_s: float = FAILOVER_S,
                 fetch_timeout_s: float = FETCH_TIMEOUT_S, bind_host: str | None = None) -> None:
        if not seeds:
            raise ValueError("give at least one seed URL (http://host:routes_port of a fleet agent)")
        self.seeds = [s.rstrip("/") for s in seeds]
        self.refresh_s, self.failover_s, self.fetch_timeout_s = refresh_s, failover_s, fetch_timeout_s
        self.bind_host = bind_host
        self.table: dict[str, Any] = {"version": -1, "apps": {}}
        self.infos: dict[str, ModelInfo] = {}
        self.failovers = 0
        self.forwarded = 0
        self.fetch_errors = 0
        self._clients: dict[Address, AsyncClient] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._fetching: asyncio.Task[int] | None = None

    async def open(self) -> Forwarder:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.fetch_timeout_s))
        await self.refresh()
        self._task = asyncio.ensure_future(self._refresher())
        return self

    async def _refresher(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def refresh(self) -> int:
        """Fetch the table (one fetch at a time: a caller during a fetch waits for it); its version."""
        if self._fetching is None or self._fetching.done():
            self._fetching = asyncio.ensure_future(self._fetch())
        return await asyncio.shield(self._fetching)

    async def _fetch(self) -> int:
        assert self._session is not None
        best: dict[str, Any] | None = None
        for url in self.seeds:
            try:
                async with self._session.get(url + "/fleet/routes") as r:
                    r.raise_for_status()
                    t = await r.json(content_type=None)
                if not isinstance(t, dict) or not isinstance(t.get("apps"), dict):
                    raise ValueError("not a routing table")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                self.fetch_errors += 1
                log.debug("front door: routing table from %s: %s", url, e)
                continue
            if best is None or int(t.get("version", -1)) > int(best.get("version", -1)):
                best = t
        if best is not None and int(best.get("version", -1)) >= int(self.table.get("version", -1)):
            self.table = best
            self.infos = {n: i for n, r in best["apps"].items() if (i := model_info_from_route(n, r)) is not None}
        return int(self.table.get("version", -1))

    def info(self, name: str) -> ModelInfo | None:
        return self.infos.get(name)

    def route(self, name: str) -> Mapping[str, Any] | None:
        return self.table.get("apps", {}).get(name)

    async def _client(self, addr: Address) -> AsyncClient:
        c = self._clients.get(addr)
        if c is None:
            c = self._clients[addr] = await AsyncClient(addr, bind_host=self.bind_host).open()
        return c

    async def rows(self, info: ModelInfo, x: np.ndarray, *, deadline_us: int, timeout_s: float,
                   marks: Marks, dtype: DType | None = None) -> list[Result | BaseException]:
        """Each row of ``x`` to the owner of ``info``'s app (and again to the standby on a failover); rows
        of ``dtype`` TENSORS are multi-tensor bodies (a model file's requests), sent as their tensors."""
        route = self.route(info.name)
        if route is None or _address(route.get("primary")) is None:
            # The table stopped routing it since the request was looked up: nowhere serves it now.
            return [Result(info.app_id, 0, Status.UNKNOWN_APP, None, 0.0, 0) for _ in range(len(x))]
        self.forwarded += len(x)
        items = [{t.name: t.array for t in decode(row)} for row in x] if dtype == DType.TENSORS else list(x)
        tasks = [asyncio.ensure_future(self._one(info, route, row, deadline_us, timeout_s)) for row in items]
        try:
            await asyncio.sleep(0)
            marks.lap("submit")
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        marks.lap("node")
        return list(results)

    async def _one(self, info: ModelInfo, route: Mapping[str, Any], row: Any, deadline_us: int,
                   timeout_s: float) -> Result:
        t0 = time.monotonic()
        primary = _address(route["primary"])
        assert primary is not None
        send = self._send(primary, info.app_id, row, deadline_us, timeout_s)
        tasks = [asyncio.ensure_future(send)]
        try:
            done, _ = await asyncio.wait(tasks, timeout=self.failover_after_s(info, timeout_s))
            winner = _usable(done)
            if winner is None:
                second = await self._second(info.name, primary, route)
                if second is not None:
                    self.failovers += 1
                    left = max(0.05, timeout_s - (time.monotonic() - t0))
                    tasks.append(asyncio.ensure_future(self._send(second, info.app_id, row, deadline_us, left)))
                winner = await self._first_usable(tasks, t0, timeout_s)
            if winner is None:
                raise RequestLost(info.app_id, 0, timeout_s, len(tasks))
            return winner.result()
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    def failover_after_s(self, info: ModelInfo, timeout_s: float) -> float:
        """How long a row waits for its owner before the standby is asked too: ``failover_s``, or the
        app's SLO where that is longer (a live owner answers by its deadline, OK or DEADLINE_MISSED, so
        only a silent one is failed over), and at most half the row's timeout."""
        return min(max(self.failover_s, info.slo_ms / 1e3), timeout_s / 2)

    async def _send(self, addr: Address, app_id: int, row: Any, deadline_us: int, timeout_s: float) -> Result:
        client = await self._client(addr)
        return await client.infer(app_id, row, deadline_us=deadline_us, timeout_s=timeout_s)

    async def _second(self, name: str, primary: Address, route: Mapping[str, Any]) -> Address | None:
        """Where to send again: the fresh table's primary if it moved, else the standby."""
        with contextlib.suppress(Exception):
            await self.refresh()
        new = self.route(name) or route
        for cand in (new.get("primary"), new.get("standby"), route.get("standby")):
            addr = _address(cand)
            if addr is not None and addr != primary:
                return addr
        return None

    async def _first_usable(self, tasks: list[asyncio.Future[Result]], t0: float,
                            timeout_s: float) -> asyncio.Future[Result] | None:
        """The first usable answer; else the last answered (its error or RequestLost); None when none came."""
        pending = {t for t in tasks if not t.done()}
        done_before = [t for t in tasks if t.done() and not t.cancelled()]
        last = done_before[-1] if done_before else None
        while pending:
            left = max(0.0, timeout_s - (time.monotonic() - t0))
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            f = _usable(done)
            if f is not None:
                return f
            last = next(iter(done))
        return last

    async def aclose(self) -> None:
        """Stop the refresher, close the owners' clients and the table's HTTP session."""
        for t in (self._task, self._fetching):
            if t is not None and not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _usable(done: set[asyncio.Future[Result]]) -> asyncio.Future[Result] | None:
    """An answered row that needs no re-send (an OK, or an error the standby would give too)."""
    for f in done:
        if not f.cancelled() and f.exception() is None and f.result().status not in FAILOVER_STATUSES:
            return f
    return None
