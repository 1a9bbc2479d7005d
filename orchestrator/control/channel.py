"""The control plane: the orchestrator talks to its instances and to the CLI.

One call shape, two transports, chosen by the address scheme (CONTRIBUTING.md, house style 7):

- ``ipc://`` (or loopback ``tcp://``) addresses use ZeroMQ: a ROUTER on the orchestrator for its
  instances (each instance a DEALER whose routing id is its instance name) and a second ROUTER for the
  CLI (a REQ per command).
- ``queue://`` addresses use in-process queues, so orchestration logic can be tested in one process.
  Messages still go through the same encoding and checks.

Typical use::

    run_dir = make_run_dir(cfg.node.run_dir)
    token = new_token(); write_token(run_dir, token)
    addr = control_address("zmq", run_dir)
    with open_server(addr, token) as server:
        env = instance_env(addr, "resnet50-0", token)      # give to the spawned instance
        ...
        item = server.recv(timeout_ms=30_000, setting="node.ready_timeout_ms")

    # in the instance process
    with connect_instance_from_env() as client:
        client.send(Ready(instance=client.instance, pid=os.getpid()))

    # in the CLI
    with connect_command(addr, read_token(run_dir)) as cli:
        reply = cli.request(StatusRequest(), timeout_ms=5000)

Security: sockets are local only (``ipc://`` inside a private run directory, mode 0700 and owned by this
user, or ``tcp://`` on loopback). Every message carries the per-run random token; a message without
it, with an unknown tag, malformed, or sent in the wrong direction is dropped and counted in
``rejected`` (never raised to the caller). Every receive has a timeout; a timeout error names the
setting to raise.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import ipaddress
import itertools
import logging
import os
import queue
import re
import secrets
import socket
import stat
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import zmq

from orchestrator.control.messages import (
    FROM_CLI,
    FROM_INSTANCE,
    FROM_ORCHESTRATOR,
    TO_CLI,
    Message,
    ProtocolError,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_LINGER_MS",
    "DEFAULT_SEND_TIMEOUT_MS",
    "ENV_ADDRESS",
    "ENV_INSTANCE",
    "ENV_TOKEN",
    "CommandClient",
    "ControlAddress",
    "ControlError",
    "ControlServer",
    "ControlTimeout",
    "Incoming",
    "InstanceClient",
    "UnknownPeer",
    "UnsafeEndpoint",
    "check_private_dir",
    "connect_command",
    "connect_instance",
    "connect_instance_from_env",
    "control_address",
    "instance_env",
    "make_run_dir",
    "make_socket",
    "new_token",
    "open_server",
    "read_token",
    "runtime_base",
    "write_token",
]

log = logging.getLogger("gpuprims.control")

ENV_ADDRESS = "GPUPRIMS_CONTROL_ADDRESS"
ENV_TOKEN = "GPUPRIMS_CONTROL_TOKEN"
ENV_INSTANCE = "GPUPRIMS_INSTANCE"
DEFAULT_HWM = 10_000
DEFAULT_LINGER_MS = 0
DEFAULT_SEND_TIMEOUT_MS = 1000
TOKEN_FILE = "token"
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the terminating NUL
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_.:/-]{1,128}$")


class ControlError(RuntimeError):
    """A control-plane operation failed (recoverable: the caller decides what to do)."""


class ControlTimeout(ControlError, TimeoutError):
    """Nothing arrived (or could be sent) in time; ``setting`` names the knob to raise."""

    def __init__(self, what: str, timeout_ms: float, setting: str) -> None:
        self.what = what
        self.timeout_ms = timeout_ms
        self.setting = setting
        super().__init__(f"{what} within {timeout_ms:g} ms; raise {setting} if this is expected to take longer")

    def __reduce__(self) -> tuple[type, tuple[str, float, str]]:
        return (type(self), (self.what, self.timeout_ms, self.setting))


class UnknownPeer(ControlError):
    """A send to an instance that is not connected."""


class UnsafeEndpoint(ControlError, PermissionError):
    """An endpoint or run directory that other users could reach; refused."""


# ---- private run directory and token


def check_private_dir(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` if it is a real directory owned by this user with no group/other access.

    Raises UnsafeEndpoint naming the path, what is wrong and the fix.
    """
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise UnsafeEndpoint(f"run directory {p} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeEndpoint(f"run directory {p} is a symlink; give the real path")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeEndpoint(f"run directory {p} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeEndpoint(f"run directory {p} is owned by uid {st.st_uid}, not by this user "
                             f"(uid {os.geteuid()}); use a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise UnsafeEndpoint(f"run directory {p} has mode {mode:04o}; it must be 0700 "
                             f"(chmod 700 {p})")
    return p


def runtime_base() -> Path:
    """This user's private parent of run directories: $XDG_RUNTIME_DIR/gpuprims or /tmp/gpuprims-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(xdg) / "gpuprims" if xdg and Path(xdg).is_dir() else Path(tempfile.gettempdir()) / f"gpuprims-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    return check_private_dir(base)


def make_run_dir(run_dir: str | os.PathLike[str] | None = None) -> Path:
    """Create (or accept) the private run directory of one node and return its absolute path.

    ``None`` makes a fresh ``run-XXXXXXXX`` directory under `runtime_base()`. A given path is created
    with mode 0700 if missing; an existing one must already be private (`check_private_dir`).
    """
    if run_dir is None:
        return Path(tempfile.mkdtemp(prefix="run-", dir=runtime_base()))
    p = Path(run_dir).expanduser().absolute()
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, 0o700)
    return check_private_dir(p)


def new_token() -> str:
    """A fresh per-run secret (64 hex characters) that instances and the CLI must present."""
    return secrets.token_hex(32)


def _check_token(token: str) -> bytes:
    if not isinstance(token, str) or not re.fullmatch(r"[0-9a-f]{32,128}", token):
        raise ValueError("token must be 32-128 lowercase hex characters (use new_token())")
    return token.encode("ascii")


def write_token(run_dir: str | os.PathLike[str], token: str) -> Path:
    """Store the token as ``<run_dir>/token`` (mode 0600) for the CLI; refuses to overwrite one."""
    _check_token(token)
    path = check_private_dir(run_dir) / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


def read_token(run_dir: str | os.PathLike[str]) -> str:
    """Read the token a node stored in its run directory, checking the directory is private."""
    path = check_private_dir(run_dir) / TOKEN_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ControlError(f"no token in {run_dir}: is a node running with this run_dir?") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise UnsafeEndpoint(f"token file {path} must be owned by this user with mode 0600")
        token = f.read().strip()
    _check_token(token)
    return token


# ---- sockets


def _check_endpoint(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://"):])
        if not path.is_absolute():
            raise UnsafeEndpoint(f"ipc endpoint {endpoint!r} must be an absolute path inside the run directory")
        if len(os.fsencode(path)) > _SUN_PATH_MAX:
            raise ControlError(f"ipc path {path} is {len(os.fsencode(path))} bytes, more than the "
                               f"{_SUN_PATH_MAX} a Unix socket allows; set node.run_dir to a shorter path")
        check_private_dir(path.parent)
    elif endpoint.startswith("tcp://"):
        hostport = endpoint[len("tcp://"):]
        host = hostport.rsplit(":", 1)[0].strip("[]")
        if host != "localhost":
            try:
                ok = ipaddress.ip_address(host).is_loopback
            except ValueError:
                ok = False
            if not ok:
                raise UnsafeEndpoint(f"tcp endpoint {endpoint!r} is not on loopback; control sockets are local only")
    elif not endpoint.startswith("inproc://"):
        raise UnsafeEndpoint(f"endpoint {endpoint!r}: only ipc://, loopback tcp:// and inproc:// are allowed")


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool, hwm: int = DEFAULT_HWM,
                linger_ms: int = DEFAULT_LINGER_MS, identity: bytes | None = None) -> zmq.Socket:
    """Create, configure and bind or connect one ZeroMQ socket; the one place sockets are made.

    Sets send/receive high-water marks (``hwm`` messages) and linger (``linger_ms``), ROUTER
    hand-over and mandatory routing (so a send to an absent instance fails instead of vanishing), and
    refuses endpoints other users could reach (see `check_private_dir`).
    """
    if hwm < 1:
        raise ValueError(f"hwm must be >= 1, got {hwm}")
    if linger_ms < 0:
        raise ValueError(f"linger_ms must be >= 0, got {linger_ms}")
    _check_endpoint(endpoint)
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if kind == zmq.REQ:
            sock.setsockopt(zmq.REQ_RELAXED, 1)
            sock.setsockopt(zmq.REQ_CORRELATE, 1)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


# ---- addresses


@dataclass(frozen=True, slots=True)
class ControlAddress:
    """Where instances and the CLI reach the orchestrator; the scheme picks the transport."""

    instances: str
    commands: str

    @property
    def kind(self) -> Literal["zmq", "inproc"]:
        """Which transport serves these addresses."""
        return "inproc" if self.instances.startswith("queue://") else "zmq"

    def __post_init__(self) -> None:
        schemes = {a.split("://", 1)[0] for a in (self.instances, self.commands)}
        if ("queue" in schemes and len(schemes) > 1) or not schemes <= {"queue", "ipc", "tcp", "inproc"}:
            raise ValueError(f"addresses must both be queue:// or both ZeroMQ endpoints, got "
                             f"{self.instances!r}, {self.commands!r}")
        if self.instances == self.commands:
            raise ValueError(f"instance and command addresses must differ, both are {self.instances!r}")


_hub_names = itertools.count(1)


def control_address(kind: Literal["zmq", "inproc"], run_dir: str | os.PathLike[str] | None = None) -> ControlAddress:
    """The addresses of one node: ipc sockets in ``run_dir`` (zmq) or a fresh in-process hub name."""
    if kind == "zmq":
        if run_dir is None:
            raise ValueError("the zmq transport needs the node's private run_dir")
        d = check_private_dir(Path(run_dir).absolute())
        return ControlAddress(f"ipc://{d}/control.sock", f"ipc://{d}/command.sock")
    if kind == "inproc":
        name = f"hub{os.getpid()}-{next(_hub_names)}"
        return ControlAddress(f"queue://{name}/instances", f"queue://{name}/commands")
    raise ValueError(f"transport kind must be 'zmq' or 'inproc', got {kind!r}")


# ---- received items and shared checks


@dataclass(frozen=True, slots=True)
class Incoming:
    """One accepted message at the orchestrator.

    ``source`` is ``"instance"`` (``peer`` is the instance name) or ``"command"`` (a CLI request;
    answer it with `ControlServer.reply`).
    """

    source: Literal["instance", "command"]
    peer: str
    msg: Message
    route: Any = field(default=None, repr=False, compare=False)


class _Rejects:
    """Counts dropped messages by reason; logs the first of each reason as a warning."""

    def __init__(self, side: str) -> None:
        self._side = side
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        level = logging.WARNING if self.counts[reason] == 1 else logging.DEBUG
        log.log(level, "%s dropped a control message (%s): %s [%d so far]", self._side, reason, detail,
                self.counts[reason])


def _check_instance_name(instance: str) -> bytes:
    if not isinstance(instance, str) or not _INSTANCE_RE.match(instance):
        raise ValueError(f"instance name must be 1-128 characters of [A-Za-z0-9_.:/-], got {instance!r}")
    return instance.encode("ascii")


def _accept(frames: list[bytes], token: bytes, allowed: frozenset[int], rejects: _Rejects,
            where: str) -> Message | None:
    try:
        got, msg = decode(frames)
    except ProtocolError as e:
        rejects.add(e.reason, f"{where}: {e.detail}")
        return None
    if not hmac.compare_digest(got, token):
        rejects.add("bad_token", f"{where}: {type(msg).__name__} without the run token")
        return None
    if type(msg).TAG not in allowed:
        rejects.add("wrong_direction", f"{where}: {type(msg).__name__} may not be sent this way")
        return None
    return msg


# ---- the orchestrator side


class _Closing(ABC):
    """``close`` (idempotent) and a with-block over a transport's ``_close``: the control server's and
    both clients'."""

    _closed: bool = False

    def close(self) -> None:
        """Release the sockets or queues; idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _close(self) -> None: ...


class _Endpoint(_Closing):
    """What the instance's and the CLI's clients share besides: a transport's send and receive."""

    @abstractmethod
    def _send(self, frames: list[bytes], timeout_ms: float, setting: str) -> None: ...

    @abstractmethod
    def _recv(self, timeout_ms: float) -> list[bytes] | None: ...


class ControlServer(_Closing):
    """The orchestrator's end: receives from instances and the CLI, sends to instances, replies to CLI.

    Not thread-safe: use it from one thread. ``rejected`` counts dropped messages by reason.
    """

    def __init__(self, address: ControlAddress, token: str) -> None:
        self.address = address
        self._token = _check_token(token)
        self._rejects = _Rejects("orchestrator")
        self._pending: collections.deque[Incoming] = collections.deque()
        self._closed = False

    @property
    def rejected(self) -> dict[str, int]:
        """Dropped messages so far, by reason (bad_token, unknown_tag, malformed, ...)."""
        return dict(self._rejects.counts)

    def send(self, instance: str, msg: Message) -> None:
        """Send ``msg`` to a connected instance without blocking.

        Raises UnknownPeer if it is not connected, ControlError if its queue is full.
        """
        self._check_open()
        if type(msg).TAG not in FROM_ORCHESTRATOR:
            raise ValueError(f"{type(msg).__name__} is not a message the orchestrator sends to instances")
        self._send_instance(_check_instance_name(instance), encode(msg, self._token))

    def reply(self, item: Incoming, msg: Message) -> None:
        """Answer a CLI request received as ``item``."""
        self._check_open()
        if item.source != "command":
            raise ValueError(f"only command requests are replied to; {item.peer} is an instance")
        if type(msg).TAG not in TO_CLI:
            raise ValueError(f"{type(msg).__name__} is not a reply to the CLI")
        self._send_reply(item.route, encode(msg, self._token))

    def poll(self, timeout_ms: float) -> Incoming | None:
        """The next accepted message, or None after ``timeout_ms`` (0 = do not wait)."""
        self._check_open()
        if timeout_ms < 0:
            raise ValueError(f"timeout_ms must be >= 0, got {timeout_ms}")
        deadline = time.monotonic() + timeout_ms / 1000
        while not self._pending:
            remaining_ms = max(0.0, (deadline - time.monotonic()) * 1000)
            raw = self._recv_raw(remaining_ms)
            for source, peer, route, frames in raw:
                allowed = FROM_INSTANCE if source == "instance" else FROM_CLI
                msg = _accept(frames, self._token, allowed, self._rejects, f"{source} {peer}")
                if msg is None:
                    continue
                if source == "instance":
                    claimed = getattr(msg, "instance", peer)
                    if claimed != peer:
                        self._rejects.add("identity_mismatch",
                                          f"{type(msg).__name__} from {peer} claims to be {claimed}")
                        continue
                self._pending.append(Incoming(source, peer, msg, route))
            if remaining_ms <= 0:
                break
        return self._pending.popleft() if self._pending else None

    def recv(self, timeout_ms: float, *, setting: str) -> Incoming:
        """The next accepted message; raises ControlTimeout naming ``setting`` if none comes in time."""
        item = self.poll(timeout_ms)
        if item is None:
            raise ControlTimeout("no control message arrived", timeout_ms, setting)
        return item

    def _check_open(self) -> None:
        if self._closed:
            raise ControlError("the control server is closed")

    @abstractmethod
    def _send_instance(self, instance: bytes, frames: list[bytes]) -> None: ...

    @abstractmethod
    def _send_reply(self, route: Any, frames: list[bytes]) -> None: ...

    @abstractmethod
    def _recv_raw(self, timeout_ms: float) -> list[tuple[str, str, Any, list[bytes]]]:
        """Whatever arrives within ``timeout_ms``: (source, peer, route, frames) tuples, maybe none."""


def _close_zmq(sockets: list[zmq.Socket], ctx: zmq.Context, paths: list[Path], linger_ms: int = 0) -> None:
    for s in sockets:
        s.close(linger=linger_ms)
    ctx.term()
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def _poll_recv(sock: zmq.Socket, timeout_ms: float) -> list[bytes] | None:
    """The next message on ``sock`` within ``timeout_ms``, or None. A socket can turn readable for a
    message it then discards: with REQ_CORRELATE, a late reply to an earlier, timed-out request. recv
    then finds nothing (EAGAIN), and the wait goes on for the rest of the time."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        remaining_ms = max(0.0, (deadline - time.monotonic()) * 1000)
        if not sock.poll(remaining_ms, zmq.POLLIN):
            return None
        try:
            return sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            if remaining_ms <= 0:
                return None


def _refuse_live_ipc(endpoint: str) -> None:
    """Refuse to bind over the ipc socket of a node that is still running (zmq would steal it)."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return  # stale socket file of a node that has gone; binding replaces it
    raise ControlError(f"another node is already serving {endpoint}; give each node its own node.run_dir")


class _ZmqServer(ControlServer):
    def __init__(self, address: ControlAddress, token: str, *, hwm: int, linger_ms: int) -> None:
        super().__init__(address, token)
        for endpoint in (address.instances, address.commands):
            _check_endpoint(endpoint)
            _refuse_live_ipc(endpoint)
        self._ctx = zmq.Context()
        try:
            self._inst = make_socket(self._ctx, zmq.ROUTER, address.instances, bind=True, hwm=hwm,
                                     linger_ms=linger_ms)
            try:
                self._cmd = make_socket(self._ctx, zmq.ROUTER, address.commands, bind=True, hwm=hwm,
                                        linger_ms=linger_ms)
            except BaseException:
                self._inst.close(linger=0)
                raise
        except BaseException:
            self._ctx.term()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._inst, zmq.POLLIN)
        self._poller.register(self._cmd, zmq.POLLIN)
        paths = [Path(a[len("ipc://"):]) for a in (address.instances, address.commands) if a.startswith("ipc://")]
        self._finalizer = weakref.finalize(self, _close_zmq, [self._inst, self._cmd], self._ctx, paths)

    def _send_instance(self, instance: bytes, frames: list[bytes]) -> None:
        try:
            self._inst.send_multipart([instance, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise ControlError(f"send queue to instance {instance.decode()} is full "
                               "(it is not reading its control socket)") from None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise UnknownPeer(f"instance {instance.decode()} is not connected") from None
            raise ControlError(f"send to instance {instance.decode()} failed: {e}") from None

    def _send_reply(self, route: Any, frames: list[bytes]) -> None:
        try:
            self._cmd.send_multipart([*route, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            # The CLI gave up (timed out and closed); nothing to answer.
            log.debug("reply to a CLI request dropped: %s", e)

    def _recv_raw(self, timeout_ms: float) -> list[tuple[str, str, Any, list[bytes]]]:
        out: list[tuple[str, str, Any, list[bytes]]] = []
        ready = dict(self._poller.poll(timeout_ms))
        if self._inst in ready:
            frames = self._inst.recv_multipart(flags=zmq.NOBLOCK)
            ident, rest = frames[0], frames[1:]
            try:
                peer = ident.decode("ascii")
                _check_instance_name(peer)
            except (UnicodeDecodeError, ValueError):
                self._rejects.add("bad_identity", f"instance routing id {ident[:32]!r} is not a valid name")
            else:
                out.append(("instance", peer, None, rest))
        if self._cmd in ready:
            frames = self._cmd.recv_multipart(flags=zmq.NOBLOCK)
            # REQ envelope: [routing id, request id, b"", payload...]; the envelope goes back as-is.
            try:
                split = frames.index(b"", 1)
            except ValueError:
                self._rejects.add("malformed", "command request without a REQ envelope")
            else:
                route = frames[:split + 1]
                out.append(("command", f"cli:{frames[0].hex()}", route, frames[split + 1:]))
        return out

    def _close(self) -> None:
        self._finalizer()


class _Hub:
    """The queues of one in-process control plane."""

    def __init__(self, name: str, hwm: int) -> None:
        self.name = name
        self.hwm = hwm
        self.inbox: queue.Queue[tuple[str, str, Any, list[bytes]]] = queue.Queue(maxsize=hwm)
        self.instances: dict[str, queue.Queue[list[bytes]]] = {}
        self.lock = threading.Lock()
        self.open = True


_HUBS: dict[str, _Hub] = {}
_HUBS_LOCK = threading.Lock()


def _hub_name(addr: str) -> str:
    return addr[len("queue://"):].split("/", 1)[0]


def _find_hub(address: str) -> _Hub:
    with _HUBS_LOCK:
        hub = _HUBS.get(_hub_name(address))
    if hub is None or not hub.open:
        raise ControlError(f"no in-process control server at {address} (open_server first)")
    return hub


class _QueueServer(ControlServer):
    def __init__(self, address: ControlAddress, token: str, *, hwm: int) -> None:
        super().__init__(address, token)
        name = _hub_name(address.instances)
        if _hub_name(address.commands) != name:
            raise ValueError(f"queue addresses must name one hub, got {address}")
        with _HUBS_LOCK:
            if name in _HUBS:
                raise ControlError(f"an in-process control server already serves {address.instances}")
            self._hub = _HUBS[name] = _Hub(name, hwm)

    def _send_instance(self, instance: bytes, frames: list[bytes]) -> None:
        with self._hub.lock:
            q = self._hub.instances.get(instance.decode())
        if q is None:
            raise UnknownPeer(f"instance {instance.decode()} is not connected")
        try:
            q.put_nowait(frames)
        except queue.Full:
            raise ControlError(f"send queue to instance {instance.decode()} is full "
                               "(it is not reading its control socket)") from None

    def _send_reply(self, route: Any, frames: list[bytes]) -> None:
        with contextlib.suppress(queue.Full):
            route.put_nowait(frames)

    def _recv_raw(self, timeout_ms: float) -> list[tuple[str, str, Any, list[bytes]]]:
        try:
            return [self._hub.inbox.get(timeout=timeout_ms / 1000) if timeout_ms > 0
                    else self._hub.inbox.get_nowait()]
        except queue.Empty:
            return []

    def _close(self) -> None:
        self._hub.open = False
        with _HUBS_LOCK:
            _HUBS.pop(self._hub.name, None)


def open_server(address: ControlAddress, token: str, *, hwm: int = DEFAULT_HWM,
                linger_ms: int = DEFAULT_LINGER_MS) -> ControlServer:
    """Bind the orchestrator's end at ``address`` with the transport its scheme names."""
    if address.kind == "inproc":
        return _QueueServer(address, token, hwm=hwm)
    return _ZmqServer(address, token, hwm=hwm, linger_ms=linger_ms)


# ---- the instance side


class InstanceClient(_Endpoint):
    """An instance's end: sends to the orchestrator and receives its commands. One thread only."""

    def __init__(self, address: ControlAddress, instance: str, token: str) -> None:
        self.address = address
        self.instance = instance
        self._ident = _check_instance_name(instance)
        self._token = _check_token(token)
        self._rejects = _Rejects(f"instance {instance}")
        self._closed = False

    @property
    def rejected(self) -> dict[str, int]:
        """Dropped messages so far, by reason."""
        return dict(self._rejects.counts)

    def send(self, msg: Message, *, timeout_ms: float = DEFAULT_SEND_TIMEOUT_MS,
             setting: str = "control send_timeout_ms") -> None:
        """Send ``msg`` to the orchestrator; raises ControlTimeout if it cannot be queued in time."""
        if self._closed:
            raise ControlError("the control client is closed")
        if type(msg).TAG not in FROM_INSTANCE:
            raise ValueError(f"{type(msg).__name__} is not a message instances send")
        claimed = getattr(msg, "instance", self.instance)
        if claimed != self.instance:
            raise ValueError(f"{type(msg).__name__} names instance {claimed!r} but this is {self.instance!r}")
        self._send(encode(msg, self._token), timeout_ms, setting)

    def poll(self, timeout_ms: float) -> Message | None:
        """The next accepted command from the orchestrator, or None after ``timeout_ms``."""
        if self._closed:
            raise ControlError("the control client is closed")
        if timeout_ms < 0:
            raise ValueError(f"timeout_ms must be >= 0, got {timeout_ms}")
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            remaining_ms = max(0.0, (deadline - time.monotonic()) * 1000)
            frames = self._recv(remaining_ms)
            if frames is None:
                return None
            msg = _accept(frames, self._token, FROM_ORCHESTRATOR, self._rejects, "orchestrator")
            if msg is not None:
                return msg
            if remaining_ms <= 0:
                return None

    def recv(self, timeout_ms: float, *, setting: str) -> Message:
        """The next accepted command; raises ControlTimeout naming ``setting`` if none comes in time."""
        msg = self.poll(timeout_ms)
        if msg is None:
            raise ControlTimeout(f"instance {self.instance} got no message from the orchestrator",
                                 timeout_ms, setting)
        return msg


class _ZmqInstanceClient(InstanceClient):
    def __init__(self, address: ControlAddress, instance: str, token: str, *, hwm: int,
                 linger_ms: int) -> None:
        super().__init__(address, instance, token)
        self._ctx = zmq.Context()
        try:
            self._sock = make_socket(self._ctx, zmq.DEALER, address.instances, bind=False, hwm=hwm,
                                     linger_ms=linger_ms, identity=self._ident)
        except BaseException:
            self._ctx.term()
            raise
        # Linger on close: what an instance says last (Ended, Error) still reaches the orchestrator.
        self._finalizer = weakref.finalize(self, _close_zmq, [self._sock], self._ctx, [], linger_ms)

    def _send(self, frames: list[bytes], timeout_ms: float, setting: str) -> None:
        if not self._sock.poll(timeout_ms, zmq.POLLOUT):
            raise ControlTimeout(f"instance {self.instance} could not send to the orchestrator",
                                 timeout_ms, setting)
        self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def _recv(self, timeout_ms: float) -> list[bytes] | None:
        return _poll_recv(self._sock, timeout_ms)

    def _close(self) -> None:
        self._finalizer()


class _QueueInstanceClient(InstanceClient):
    def __init__(self, address: ControlAddress, instance: str, token: str) -> None:
        super().__init__(address, instance, token)
        self._hub = _find_hub(address.instances)
        self._q: queue.Queue[list[bytes]] = queue.Queue(maxsize=self._hub.hwm)
        with self._hub.lock:
            # Like ROUTER hand-over: a reconnecting instance takes over its name.
            self._hub.instances[instance] = self._q

    def _send(self, frames: list[bytes], timeout_ms: float, setting: str) -> None:
        if not self._hub.open:
            raise ControlError(f"the in-process control server at {self.address.instances} is closed")
        try:
            self._hub.inbox.put(("instance", self.instance, None, frames), timeout=timeout_ms / 1000)
        except queue.Full:
            raise ControlTimeout(f"instance {self.instance} could not send to the orchestrator",
                                 timeout_ms, setting) from None

    def _recv(self, timeout_ms: float) -> list[bytes] | None:
        try:
            return self._q.get(timeout=timeout_ms / 1000) if timeout_ms > 0 else self._q.get_nowait()
        except queue.Empty:
            return None

    def _close(self) -> None:
        with self._hub.lock:
            if self._hub.instances.get(self.instance) is self._q:
                del self._hub.instances[self.instance]


def connect_instance(address: ControlAddress, instance: str, token: str, *, hwm: int = DEFAULT_HWM,
                     linger_ms: int = DEFAULT_LINGER_MS) -> InstanceClient:
    """Connect instance ``instance`` to the orchestrator at ``address``."""
    if address.kind == "inproc":
        return _QueueInstanceClient(address, instance, token)
    return _ZmqInstanceClient(address, instance, token, hwm=hwm, linger_ms=linger_ms)


def instance_env(address: ControlAddress, instance: str, token: str) -> dict[str, str]:
    """Environment variables that let a spawned instance connect (`connect_instance_from_env`)."""
    _check_instance_name(instance)
    _check_token(token)
    return {ENV_ADDRESS: f"{address.instances} {address.commands}", ENV_TOKEN: token, ENV_INSTANCE: instance}


def connect_instance_from_env(environ: Mapping[str, str] | None = None, **kwargs: Any) -> InstanceClient:
    """Connect using the variables `instance_env` set; ControlError names any that is missing."""
    env = os.environ if environ is None else environ
    missing = [k for k in (ENV_ADDRESS, ENV_TOKEN, ENV_INSTANCE) if not env.get(k)]
    if missing:
        raise ControlError(f"missing environment variable(s) {', '.join(missing)}: this process must be "
                           "started by gpuprims-orchestrator")
    parts = env[ENV_ADDRESS].split()
    if len(parts) != 2:
        raise ControlError(f"{ENV_ADDRESS} must hold two addresses separated by a space, got {env[ENV_ADDRESS]!r}")
    return connect_instance(ControlAddress(parts[0], parts[1]), env[ENV_INSTANCE], env[ENV_TOKEN], **kwargs)


# ---- the CLI side


class CommandClient(_Endpoint):
    """The CLI's end: one request, one reply, with a timeout."""

    def __init__(self, address: ControlAddress, token: str) -> None:
        self.address = address
        self._token = _check_token(token)
        self._rejects = _Rejects("cli")
        self._closed = False

    @property
    def rejected(self) -> dict[str, int]:
        """Dropped replies so far, by reason."""
        return dict(self._rejects.counts)

    def request(self, msg: Message, *, timeout_ms: float, setting: str = "--timeout") -> Message:
        """Send a CLI request and return the node's reply; ControlTimeout names ``setting``."""
        if self._closed:
            raise ControlError("the command client is closed")
        if type(msg).TAG not in FROM_CLI:
            raise ValueError(f"{type(msg).__name__} is not a CLI request")
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0, got {timeout_ms}")
        deadline = time.monotonic() + timeout_ms / 1000
        self._send(encode(msg, self._token), timeout_ms, setting)
        while True:
            remaining_ms = max(0.0, (deadline - time.monotonic()) * 1000)
            frames = self._recv(remaining_ms)
            if frames is None:
                raise ControlTimeout(f"the node did not answer {type(msg).__name__} at {self.address.commands}",
                                     timeout_ms, setting)
            reply = _accept(frames, self._token, TO_CLI, self._rejects, "node")
            if reply is not None:
                return reply
            if remaining_ms <= 0:
                raise ControlTimeout(f"the node sent no valid answer to {type(msg).__name__}", timeout_ms, setting)


class _ZmqCommandClient(CommandClient):
    def __init__(self, address: ControlAddress, token: str) -> None:
        super().__init__(address, token)
        self._ctx = zmq.Context()
        try:
            self._sock = make_socket(self._ctx, zmq.REQ, address.commands, bind=False, hwm=16, linger_ms=0)
        except BaseException:
            self._ctx.term()
            raise
        self._finalizer = weakref.finalize(self, _close_zmq, [self._sock], self._ctx, [])

    def _send(self, frames: list[bytes], timeout_ms: float, setting: str) -> None:
        if not self._sock.poll(timeout_ms, zmq.POLLOUT):
            raise ControlTimeout(f"could not reach the node at {self.address.commands}", timeout_ms, setting)
        self._sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def _recv(self, timeout_ms: float) -> list[bytes] | None:
        return _poll_recv(self._sock, timeout_ms)

    def _close(self) -> None:
        self._finalizer()


class _QueueCommandClient(CommandClient):
    def __init__(self, address: ControlAddress, token: str) -> None:
        super().__init__(address, token)
        self._hub = _find_hub(address.commands)
        self._n = 0
        self._replies: queue.Queue[list[bytes]] = queue.Queue(maxsize=4)

    def _send(self, frames: list[bytes], timeout_ms: float, setting: str) -> None:
        # A fresh reply queue per request, so a late reply to an earlier request is never read.
        self._replies = queue.Queue(maxsize=4)
        self._n += 1
        try:
            self._hub.inbox.put(("command", f"cli:{id(self):x}:{self._n}", self._replies, frames),
                                timeout=timeout_ms / 1000)
        except queue.Full:
            raise ControlTimeout(f"could not reach the node at {self.address.commands}", timeout_ms,
                                 setting) from None

    def _recv(self, timeout_ms: float) -> list[bytes] | None:
        try:
            return self._replies.get(timeout=timeout_ms / 1000) if timeout_ms > 0 else self._replies.get_nowait()
        except queue.Empty:
            return None

    def _close(self) -> None:
        # Reply queues belong to single requests; dropping the last one is all there is to release.
        self._replies = queue.Queue(maxsize=1)


def connect_command(address: ControlAddress, token: str) -> CommandClient:
    """Connect the CLI to the node at ``address`` (token from `read_token(run_dir)`)."""
    if address.kind == "inproc":
        return _QueueCommandClient(address, token)
    return _ZmqCommandClient(address, token)
