"""The front door's lifetime: one asyncio loop in a background thread hosting both servers.

Why a thread and not a process: the node process's own Python work is its control loop (ticks of a
few milliseconds) while the ingest, the part on every request's path, is native and holds no GIL;
a thread needs no supervision, no IPC and no second copy of the config. Given the node's ``ingest``,
its requests go straight into the packet pool (``PoolTransport``: no datagrams, no loopback, answers
back in-process); without it they reach the node through the UDP ingest at ``udp_target`` like any
client's (``UdpTransport``), which is all a front door in a process of its own would need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from gpuprims.client import AsyncClient
from gpuprims.ingest import Ingest
from orchestrator.config.schema import AppConfig
from orchestrator.control.stats import AppStatistics
from orchestrator.frontdoor.core import Core, Unavailable
from orchestrator.frontdoor.forward import Forwarder
from orchestrator.frontdoor.grpc_server import make_server
from orchestrator.frontdoor.http_server import make_app
from orchestrator.frontdoor.models import DEFAULT_REQUEST_BYTES, ModelInfo, model_info
from orchestrator.frontdoor.security import ServerTls, TokenGuard, plaintext_warning
from orchestrator.frontdoor.transport import PoolTransport, Transport, UdpTransport

log = logging.getLogger("gpuprims.frontdoor")
#: How long start_frontdoor waits for both servers to listen.
START_TIMEOUT_S = 30.0
#: How long close() lets in-flight calls finish before they are cut.
STOP_GRACE_S = 1.0


class FrontDoorError(RuntimeError):
    """The front door could not start (a port in use, a bad address)."""


class FrontDoor:
    """A running front door. ``http_url`` / ``grpc_target`` are None for a server that is off."""

    def __init__(self, infos: list[ModelInfo], udp_target: tuple[str, int], host: str,
                 http_port: int | None, grpc_port: int | None, *, timeout_s: float | None,
                 ready: Callable[[str], bool] | None, statistics: Mapping[str, AppStatistics] | None = None,
                 ingest: Ingest | None = None, repository: Any = None, repository_token: str | None = None,
                 fleet_routes: Sequence[str] = (), tls: ServerTls | None = None,
                 inference_token: str | None = None) -> None:
        self.models = infos
        self.max_request_bytes = DEFAULT_REQUEST_BYTES  # a dynamic model file's request bound (add_model)
        self.unavailable: list[Unavailable] = []  # the model repository's models that cannot be served
        self.fleet_routes = list(fleet_routes)
        self.udp_target = udp_target
        self.ingest = ingest
        self._via = "pool" if ingest is not None else f"udp={udp_target}"
        self.host = host
        self.http_url: str | None = None
        self.grpc_target: str | None = None
        self.core: Core | None = None
        self._http_port, self._grpc_port = http_port, grpc_port
        self._timeout_s, self._ready, self._statistics = timeout_s, ready, statistics
        self._repository, self._repository_token = repository, repository_token
        self.tls = tls
        #: The inference token's check and its count of refusals per protocol (None: no token).
        self.guard = TokenGuard(inference_token) if inference_token is not None else None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stop = asyncio.Event()  # bound to the loop at its first use, in the loop's thread
        self._thread = threading.Thread(target=self._run, name="gpuprims-frontdoor", daemon=True)
        self._fin = weakref.finalize(self, _shutdown, self._loop, self._thread, self._stop)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start() / close()
            self._error = e
            self._started.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        transport: Transport
        if self.ingest is not None:
            transport = PoolTransport(self.ingest).open()
        else:
            transport = UdpTransport(await AsyncClient(self.udp_target, bind_host=self.udp_target[0]).open())
        forwarder = await Forwarder(self.fleet_routes).open() if self.fleet_routes else None
        self.core = Core(self.models, transport, timeout_s=self._timeout_s, ready=self._ready,
                         statistics=self._statistics, forwarder=forwarder)
        self.core.unavailable = self.unavailable
        runner: web.AppRunner | None = None
        grpc_server = None
        lag = asyncio.ensure_future(self.core.watch_lag())  # for overload shedding (Core.admit)
        try:
            host_url = f"[{self.host}]" if ":" in self.host else self.host
            if self._http_port is not None:
                app = make_app(self.core, self._repository, self._repository_token)
                if self.guard is not None:  # innermost: runs once the route is known, before the body is read
                    app.middlewares.append(self.guard.http_middleware())
                runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=STOP_GRACE_S)
                await runner.setup()
                site = web.TCPSite(runner, self.host, self._http_port, reuse_address=True,
                                   ssl_context=self.tls.context if self.tls is not None else None)
                try:
                    await site.start()
                except OSError as e:
                    raise FrontDoorError(f"cannot serve HTTP on {self.host}:{self._http_port}: {e.strerror or e}; "
                                         "pick another node.http_port") from None
                port = runner.addresses[0][1]
                self.http_url = f"{'https' if self.tls is not None else 'http'}://{host_url}:{port}"
            if self._grpc_port is not None:
                grpc_server = make_server(self.core, models_change=self._repository is not None or forwarder is not None,
                                          interceptors=[self.guard.grpc_interceptor()] if self.guard else [])
                address = f"{host_url}:{self._grpc_port}"
                try:
                    port = (grpc_server.add_secure_port(address, self.tls.grpc_credentials()) if self.tls is not None
                            else grpc_server.add_insecure_port(address))
                except RuntimeError as e:
                    raise FrontDoorError(f"cannot serve gRPC on {self.host}:{self._grpc_port}: {e}; "
                                         "pick another node.grpc_port") from None
                await grpc_server.start()
                self.grpc_target = f"{host_url}:{port}"
            log.info("front door: HTTP %s, gRPC %s -> %s", self.http_url or "off", self.grpc_target or "off",
                     "the packet pool" if self.ingest is not None else "UDP {}:{}".format(*self.udp_target))
            warning = plaintext_warning(self.host, self.tls, self.guard.token if self.guard else None)
            if warning is not None:
                log.warning(warning)
            self._started.set()
            await self._stop.wait()
        finally:
            lag.cancel()
            if grpc_server is not None:
                await grpc_server.stop(grace=STOP_GRACE_S)
            if runner is not None:
                await runner.cleanup()
            transport.close()
            if forwarder is not None:
                await forwarder.aclose()
            self.core.release()
            # Nothing of the node outlives the stop (its ingest, its readiness, its repository).
            self.ingest, self._ready, self._repository = None, None, None

    def _start(self) -> FrontDoor:
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            self.close()
            raise FrontDoorError(f"front door did not start within {START_TIMEOUT_S:g} s")
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def stages(self, *, reset: bool = False, timeout_s: float = 5.0) -> dict[str, Any]:
        """Where each protocol's inferences spent their time: ``Core.stages()``, read on the loop
        (``reset``: and start counting afresh)."""
        core = self.core
        if core is None or not self._thread.is_alive():
            return {}

        async def read() -> dict[str, Any]:
            out = core.stages()
            if reset:
                core.clocks.clear()
            return out

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(timeout_s)

    def add_model(self, app: AppConfig, statistics: AppStatistics | None = None) -> None:
        """Serve ``app`` from now on (a load; any thread): its model info is built here, the swap is done
        in the front door's loop. Its inferences are counted in ``statistics`` (the node's record of the
        app); without it the model keeps the record it had, or gets one of its own."""
        info = model_info(app, self.max_request_bytes)
        self._loop.call_soon_threadsafe(self._swap_model, app.name, info, statistics)

    def remove_model(self, name: str) -> None:
        """Stop serving the model ``name`` (an unload; any thread)."""
        self._loop.call_soon_threadsafe(self._swap_model, name, None, None)

    def _swap_model(self, name: str, info: ModelInfo | None, statistics: AppStatistics | None) -> None:
        core = self.core
        if core is None:
            return
        if info is None:
            core.models.pop(name, None)
        else:
            core.models[name] = info
            if statistics is not None:
                core.stats[name] = statistics
            else:
                core.stats.setdefault(name, AppStatistics())

    def close(self) -> None:
        """Stop both servers (in-flight calls get a second to finish) and the loop thread."""
        self._fin()

    def __enter__(self) -> FrontDoor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FrontDoor(http={self.http_url}, grpc={self.grpc_target}, {self._via})"


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, stop: asyncio.Event) -> None:
    if thread.is_alive():
        with contextlib.suppress(RuntimeError):  # the loop closed already
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
    elif not loop.is_closed() and not thread.ident:  # never started
        loop.close()


def start_frontdoor(apps: Sequence[AppConfig], udp_target: tuple[str, int], http_port: int | None,
                    grpc_port: int | None, host: str = "127.0.0.1", *, timeout_s: float | None = None,
                    ready: Callable[[str], bool] | None = None,
                    statistics: Mapping[str, AppStatistics] | None = None, ingest: Ingest | None = None,
                    repository: Any = None, repository_token: str | None = None,
                    fleet_routes: Sequence[str] = (), max_request_bytes: int = DEFAULT_REQUEST_BYTES,
                    unavailable: Sequence[Unavailable] = (), tls: ServerTls | None = None,
                    inference_token: str | None = None) -> FrontDoor:
    """Serve ``apps`` over the Open Inference Protocol, forwarding to the UDP ingest at ``udp_target``.

    ``http_port`` / ``grpc_port``: a port, 0 for any free port, None for off (apps.yaml's 0 = off
    becomes None at the caller). ``ready(app_name)`` tells the servers whether the node serves an
    app now (default: always). ``timeout_s`` bounds each request's wait for the node's answer
    (default: max(2 s, 3 x the app's SLO)). ``statistics`` holds each app's `AppStatistics` (the
    node's), which the front door counts its inferences in and its statistics extension reads;
    without it each app gets a record of its own. With ``ingest`` (the node's own, in this process) rows go
    straight into its packet pool and their answers come back in-process; ``udp_target`` is then only
    shown in logs. ``repository`` (with its bearer ``repository_token``, or None for none) adds the
    model-repository load/unload routes (docs/oip.md). ``fleet_routes`` (seed URLs of a fleet's routing
    table, docs/fleet.md) forwards requests for models this node does not host to their owners
    (orchestrator/frontdoor/forward.py). ``max_request_bytes`` bounds one request of a model file with
    dynamic dimensions (the node's pool: node.pool.max_chunks x max_payload). ``tls`` (security.load_tls)
    serves HTTPS and gRPC over TLS; ``inference_token`` is the bearer token every inference must carry
    (security.TokenGuard; None: none). Returns once both servers listen, or raises FrontDoorError;
    ``close()`` stops it.
    """
    if http_port is None and grpc_port is None:
        raise ValueError("start_frontdoor needs http_port or grpc_port (None means off)")
    for name, p in (("http_port", http_port), ("grpc_port", grpc_port)):
        if p is not None and not 0 <= p <= 65535:
            raise ValueError(f"{name} must be in 0..65535 or None, got {p}")
    infos = [model_info(a, max_request_bytes) for a in apps]
    door = FrontDoor(infos, (str(udp_target[0]), int(udp_target[1])), host, http_port, grpc_port,
                     timeout_s=timeout_s, ready=ready, statistics=statistics, ingest=ingest,
                     repository=repository, repository_token=repository_token, fleet_routes=fleet_routes,
                     tls=tls, inference_token=inference_token)
    door.max_request_bytes = max_request_bytes
    door.unavailable = list(unavailable)
    return door._start()
