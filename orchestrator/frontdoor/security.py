"""What makes the front door safe beyond loopback: TLS from certificate and key files, and a bearer token
for inference (docs/oip.md, "TLS and tokens").

TLS is the servers' own: aiohttp serves HTTPS with an ``ssl.SSLContext``, grpc.aio serves TLS with
``grpc.ssl_server_credentials``; nothing here touches a handshake. A failed handshake (a client that
does not trust the certificate, a plain-text client on the TLS port) ends that one connection inside
the server library and leaves every other connection alone.

The token: with one configured, every inference (``POST .../infer``, gRPC ``ModelInfer``) must carry
``Authorization: Bearer <token>`` (gRPC metadata ``authorization``), compared in constant time
(:func:`orchestrator.frontdoor.repository_api.authorized`, the repository API's check). One without it is
answered 401 / UNAUTHENTICATED before its body is read or its message parsed, and counted in
:attr:`TokenGuard.refused`. Health, metadata, configuration and statistics stay open.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from orchestrator.config.schema import is_loopback
from orchestrator.frontdoor.core import HTTP_CODE
from orchestrator.frontdoor.repository_api import authorized

#: The gRPC method a token guards (the streaming one answers UNIMPLEMENTED whatever it carries).
GUARDED_GRPC_METHODS = frozenset({"/inference.GRPCInferenceService/ModelInfer",
                                  "/inference.GRPCInferenceService/ModelStreamInfer"})


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be served (missing, unreadable, not PEM, not a pair)."""


@dataclass(frozen=True)
class ServerTls:
    """A certificate and its key (and a client CA, for mutual TLS), read and checked once: the HTTP
    server's ``context`` and the PEM bytes gRPC takes."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes | None
    context: ssl.SSLContext

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The same certificate for grpc.aio's ``add_secure_port`` (client certificates required with a CA)."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=self.ca_pem is not None)

    @property
    def mutual(self) -> bool:
        return self.ca_pem is not None


def _read(path: str | Path, key: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise TlsError(f"{key} {str(path)!r} cannot be read: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{key} {str(path)!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def load_tls(cert: str | Path, key: str | Path, ca: str | Path | None = None, *,
             setting: str = "node.tls") -> ServerTls:
    """Read and check the PEM files of ``setting`` (named in every error): the certificate chain ``cert``,
    its private key ``key``, and ``ca``, the CA a client certificate must be signed by (None: clients are
    not asked for one). Raises TlsError when a file is missing or the key does not match the certificate."""
    cert_pem, key_pem = _read(cert, f"{setting}.cert"), _read(key, f"{setting}.key")
    ca_pem = _read(ca, f"{setting}.ca") if ca is not None else None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(Path(cert).expanduser(), Path(key).expanduser())
    except ssl.SSLError as e:
        raise TlsError(f"{setting}.cert {str(cert)!r} and {setting}.key {str(key)!r} are not a certificate and its "
                       f"key: {e.reason or e}") from None
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=str(Path(ca).expanduser()))
        except ssl.SSLError as e:
            raise TlsError(f"{setting}.ca {str(ca)!r} holds no CA certificate: {e.reason or e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ServerTls(cert_pem, key_pem, ca_pem, ctx)


def plaintext_warning(host: str, tls: ServerTls | None, token: str | None) -> str | None:
    """The one warning a front door on ``host`` logs at its start when it serves inference in plain text
    beyond loopback, or None (TLS on, or loopback only)."""
    if tls is not None or is_loopback(host):
        return None
    who = "its bearer token and " if token is not None else "anyone who reaches it can infer, and "
    return (f"the front door serves inference in plain text on {host!r} (not loopback): {who}every tensor "
            "cross the network readable; set node.tls (cert, key) or start --tls-cert/--tls-key")


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class TokenGuard:
    """The bearer token every inference must carry, and how many were refused, per protocol."""

    token: str
    refused: dict[str, int] = field(default_factory=lambda: {"http": 0, "grpc": 0})

    def __post_init__(self) -> None:
        if not self.token or self.token != self.token.strip():
            raise ValueError("the inference token must be non-empty, without surrounding white space")

    def allows(self, header: str | None, protocol: str) -> bool:
        """True when ``header`` (an Authorization value) carries the token; a refusal is counted."""
        if authorized(header, self.token):
            return True
        self.refused[protocol] += 1
        return False

    def http_middleware(self) -> Any:
        """An aiohttp middleware refusing an inference without the token with 401 and
        ``WWW-Authenticate: Bearer``, before its body is read (the connection is closed after the answer)."""

        @web.middleware
        async def require_token(request: web.Request, handler: _Handler) -> web.StreamResponse:
            route = request.match_info.route
            resource = route.resource
            if (route.method == "POST" and resource is not None and resource.canonical.endswith("/infer")
                    and not self.allows(request.headers.get("Authorization"), "http")):
                resp = web.json_response({"error": "inference needs 'Authorization: Bearer <token>' (node.auth)"},
                                         status=HTTP_CODE["unauthenticated"], headers={"WWW-Authenticate": "Bearer"})
                resp.force_close()  # its body is not read: the connection cannot carry another request
                return resp
            return await handler(request)

        return require_token

    def grpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        """A grpc.aio interceptor refusing ModelInfer without metadata ``authorization: Bearer <token>``
        with UNAUTHENTICATED, before the message is parsed."""
        return _TokenInterceptor(self)


async def _refuse(request: Any, ctx: grpc.aio.ServicerContext) -> None:
    await ctx.abort(grpc.StatusCode.UNAUTHENTICATED,
                    "inference needs metadata 'authorization: Bearer <token>' (node.auth)")


_REFUSE = grpc.unary_unary_rpc_method_handler(_refuse)


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, guard: TokenGuard) -> None:
        self.guard = guard

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method in GUARDED_GRPC_METHODS:  # type: ignore[attr-defined]
            header = next((str(v) for k, v in details.invocation_metadata or ()  # type: ignore[attr-defined]
                           if k == "authorization"), None)
            if not self.guard.allows(header, "grpc"):
                return _REFUSE
        return await continuation(details)
