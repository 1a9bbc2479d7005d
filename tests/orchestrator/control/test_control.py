from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from orchestrator.control import channel as control
from orchestrator.control.channel import (
    ControlAddress,
    ControlError,
    ControlServer,
    ControlTimeout,
    UnknownPeer,
    UnsafeEndpoint,
    check_private_dir,
    connect_command,
    connect_instance,
    connect_instance_from_env,
    control_address,
    instance_env,
    make_run_dir,
    make_socket,
    new_token,
    open_server,
    read_token,
    write_token,
)
from orchestrator.control.messages import (
    Ended,
    Finish,
    Heartbeat,
    Ready,
    Result,
    Shutdown,
    StatusReply,
    StatusRequest,
    StopRequest,
    encode,
)
from orchestrator.control.records import InstanceStats

pytestmark = pytest.mark.timeout(60)

#: How long the control server may take to take in what was sent, on a busy machine (waits end as soon
#: as their condition holds).
REACT_S = 30.0


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run_dir(tmp_path / "run")


@pytest.fixture
def token() -> str:
    return new_token()


@pytest.fixture(params=["zmq", "inproc"])
def server(request: pytest.FixtureRequest, run_dir: Path, token: str) -> Iterator[ControlServer]:
    s = open_server(control_address(request.param, run_dir), token)
    yield s
    s.close()


def _recv(server: ControlServer, timeout_ms: float = 5000) -> control.Incoming:
    return server.recv(timeout_ms, setting="test")


# ---- run directory and token


def test_make_run_dir_fresh_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    a, b = make_run_dir(), make_run_dir()
    assert a != b and a.parent == xdg / "gpuprims"
    for d in (a, b, a.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_make_run_dir_explicit(tmp_path: Path) -> None:
    d = make_run_dir(tmp_path / "x" / "run")
    assert d.is_dir() and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert make_run_dir(d) == d


def test_open_dir_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o755)
    with pytest.raises(UnsafeEndpoint, match=r"mode 0755.*chmod 700"):
        make_run_dir(d)


def test_symlink_missing_and_file_refused(tmp_path: Path) -> None:
    real = make_run_dir(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeEndpoint, match="symlink"):
        check_private_dir(link)
    with pytest.raises(UnsafeEndpoint, match="does not exist"):
        check_private_dir(tmp_path / "none")
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(UnsafeEndpoint, match="not a directory"):
        check_private_dir(f)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_foreign_owner_refused(tmp_path: Path) -> None:
    d = make_run_dir(tmp_path / "theirs")
    os.chown(d, 65534, 65534)
    with pytest.raises(UnsafeEndpoint, match="owned by uid 65534"):
        check_private_dir(d)


def test_token_file(run_dir: Path, token: str) -> None:
    p = write_token(run_dir, token)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert read_token(run_dir) == token
    with pytest.raises(FileExistsError):
        write_token(run_dir, new_token())
    p.chmod(0o644)
    with pytest.raises(UnsafeEndpoint, match="0600"):
        read_token(run_dir)


def test_token_missing_and_malformed(run_dir: Path) -> None:
    with pytest.raises(ControlError, match="no token"):
        read_token(run_dir)
    with pytest.raises(ValueError, match="hex"):
        write_token(run_dir, "short")
    with pytest.raises(ValueError, match="hex"):
        open_server(control_address("inproc"), "not-a-token")


# ---- socket factory


def test_make_socket_sets_options(run_dir: Path) -> None:
    ctx = zmq.Context()
    try:
        s = make_socket(ctx, zmq.ROUTER, f"ipc://{run_dir}/x.sock", bind=True, hwm=7, linger_ms=3)
        assert s.getsockopt(zmq.LINGER) == 3
        assert s.getsockopt(zmq.SNDHWM) == 7 and s.getsockopt(zmq.RCVHWM) == 7
        s.close()
    finally:
        ctx.term()


@pytest.mark.parametrize(("endpoint", "error", "fragment"), [
    ("tcp://0.0.0.0:5555", UnsafeEndpoint, "not on loopback"),
    ("tcp://10.1.2.3:5555", UnsafeEndpoint, "not on loopback"),
    ("ipc://relative.sock", UnsafeEndpoint, "absolute"),
    ("ipc:///tmp/x" + "y" * 200 + ".sock", ControlError, "shorter path"),
    ("udp://127.0.0.1:5", UnsafeEndpoint, "only ipc://"),
])
def test_make_socket_refuses(endpoint: str, error: type[Exception], fragment: str) -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(error, match=fragment):
            make_socket(ctx, zmq.ROUTER, endpoint, bind=True)
    finally:
        ctx.term()


def test_make_socket_refuses_ipc_in_open_dir(tmp_path: Path) -> None:
    d = tmp_path / "pub"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    ctx = zmq.Context()
    try:
        with pytest.raises(UnsafeEndpoint, match="must be 0700"):
            make_socket(ctx, zmq.ROUTER, f"ipc://{d}/c.sock", bind=True)
    finally:
        ctx.term()


def test_make_socket_bad_numbers(run_dir: Path) -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="hwm"):
            make_socket(ctx, zmq.ROUTER, f"ipc://{run_dir}/a.sock", bind=True, hwm=0)
        with pytest.raises(ValueError, match="linger"):
            make_socket(ctx, zmq.ROUTER, f"ipc://{run_dir}/a.sock", bind=True, linger_ms=-1)
    finally:
        ctx.term()


def test_loopback_tcp_allowed(token: str) -> None:
    assert ControlAddress("tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002").kind == "zmq"
    ctx = zmq.Context()
    try:
        for ep in ("tcp://127.0.0.1:*", "tcp://localhost:*"):
            s = make_socket(ctx, zmq.ROUTER, ep, bind=True)
            assert s.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://127.0.0.1:")
            s.close()
    finally:
        ctx.term()


# ---- addresses


def test_addresses(run_dir: Path) -> None:
    a = control_address("zmq", run_dir)
    assert a.kind == "zmq" and a.instances.startswith(f"ipc://{run_dir}/")
    b = control_address("inproc")
    assert b.kind == "inproc" and b != control_address("inproc")
    with pytest.raises(ValueError, match="run_dir"):
        control_address("zmq")
    with pytest.raises(ValueError, match="'zmq' or 'inproc'"):
        control_address("grpc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both"):
        ControlAddress("queue://h/instances", "ipc:///tmp/x")
    with pytest.raises(ValueError, match="differ"):
        ControlAddress("ipc:///tmp/x", "ipc:///tmp/x")


# ---- both transports, one call shape


def test_instance_round_trip(server: ControlServer, token: str) -> None:
    with connect_instance(server.address, "app-0", token) as c:
        c.send(Ready(instance="app-0", pid=os.getpid(), info={"k": 1}, blobs=(b"\x01" * 5000,)))
        item = _recv(server)
        assert item.source == "instance" and item.peer == "app-0"
        assert item.msg == Ready(instance="app-0", pid=os.getpid(), info={"k": 1}, blobs=(b"\x01" * 5000,))
        server.send("app-0", Finish(instance="app-0"))
        assert c.recv(5000, setting="test") == Finish(instance="app-0")
        c.send(Ended(instance="app-0", drained_count=3))
        assert _recv(server).msg == Ended(instance="app-0", drained_count=3)
    assert server.rejected == {}


def test_several_instances(server: ControlServer, token: str) -> None:
    clients = [connect_instance(server.address, f"i{k}", token) for k in range(3)]
    try:
        for c in clients:
            c.send(Heartbeat(instance=c.instance, stats=InstanceStats(received=1)))
        peers = {_recv(server).peer for _ in clients}
        assert peers == {"i0", "i1", "i2"}
        for c in clients:
            server.send(c.instance, Shutdown(instance=c.instance, drain=True))
        for c in clients:
            assert c.recv(5000, setting="test") == Shutdown(instance=c.instance, drain=True)
    finally:
        for c in clients:
            c.close()


def test_wrong_token_refused_and_counted(server: ControlServer, token: str) -> None:
    with connect_instance(server.address, "evil", new_token()) as bad, \
            connect_instance(server.address, "good", token) as good:
        bad.send(Heartbeat(instance="evil"))
        bad.send(Heartbeat(instance="evil"))
        good.send(Heartbeat(instance="good"))
        item = _recv(server)
        assert item.peer == "good"
        assert server.poll(100) is None
        assert server.rejected == {"bad_token": 2}


def test_instance_refuses_forged_orchestrator(server: ControlServer, token: str) -> None:
    # A second server on another address cannot reach the instance; a wrong-token frame from the
    # right server (simulated by sending raw frames) is dropped by the instance.
    with connect_instance(server.address, "app-0", token) as c:
        c.send(Heartbeat(instance="app-0"))
        _recv(server)
        server._send_instance(b"app-0", encode(Finish(instance="app-0"), new_token().encode()))
        server._send_instance(b"app-0", encode(Ended(instance="app-0", drained_count=1), token.encode()))
        server._send_instance(b"app-0", [b"garbage"])
        assert c.poll(300) is None
        assert c.rejected == {"bad_token": 1, "wrong_direction": 1, "malformed": 1}


def test_send_to_unknown_instance(server: ControlServer) -> None:
    with pytest.raises(UnknownPeer, match="ghost"):
        server.send("ghost", Finish(instance="ghost"))


def test_api_refuses_wrong_direction(server: ControlServer, token: str) -> None:
    with pytest.raises(ValueError, match="orchestrator sends"):
        server.send("a", Ready(instance="a", pid=1))
    with connect_instance(server.address, "a", token) as c:
        with pytest.raises(ValueError, match="instances send"):
            c.send(Finish(instance="a"))
        with pytest.raises(ValueError, match="names instance 'b'"):
            c.send(Heartbeat(instance="b"))
    with connect_command(server.address, token) as cli, pytest.raises(ValueError, match="CLI request"):
        cli.request(Finish(instance="a"), timeout_ms=100)
    with pytest.raises(ValueError, match="instance name"):
        connect_instance(server.address, "bad name!", token)


def test_timeouts_name_the_setting(server: ControlServer, token: str) -> None:
    with pytest.raises(ControlTimeout, match=r"within 50 ms; raise node\.ready_timeout_ms") as ei:
        server.recv(50, setting="node.ready_timeout_ms")
    assert ei.value.setting == "node.ready_timeout_ms"
    with connect_instance(server.address, "a", token) as c, pytest.raises(ControlTimeout, match="heartbeat_ms"):
        c.recv(50, setting="heartbeat_ms")
    with connect_command(server.address, token) as cli, pytest.raises(ControlTimeout, match="--timeout"):
        cli.request(StatusRequest(), timeout_ms=100)
    assert server.poll(0) is not None  # the unanswered request arrived


def test_control_timeout_pickles() -> None:
    e = pickle.loads(pickle.dumps(ControlTimeout("x", 5, "s")))
    assert e.setting == "s" and "raise s" in str(e)


def test_negative_timeouts(server: ControlServer, token: str) -> None:
    with pytest.raises(ValueError, match="timeout_ms"):
        server.poll(-1)
    with connect_instance(server.address, "a", token) as c, pytest.raises(ValueError, match="timeout_ms"):
        c.poll(-1)
    with connect_command(server.address, token) as cli, pytest.raises(ValueError, match="timeout_ms"):
        cli.request(StatusRequest(), timeout_ms=0)


def _serve(server: ControlServer, n: int) -> threading.Thread:
    def loop() -> None:
        for _ in range(n):
            item = server.poll(REACT_S * 1000)
            if item is None:
                return
            if isinstance(item.msg, StatusRequest):
                server.reply(item, StatusReply(status={"apps": [], "seen": item.peer}))
            else:
                server.reply(item, Result(ok=True, message=type(item.msg).__name__))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_command_request_reply(server: ControlServer, token: str) -> None:
    t = _serve(server, 2)
    with connect_command(server.address, token) as cli:
        r = cli.request(StatusRequest(), timeout_ms=REACT_S * 1000)
        assert isinstance(r, StatusReply) and r.status["apps"] == []
        assert cli.request(StopRequest(drain=True), timeout_ms=REACT_S * 1000) == Result(ok=True, message="StopRequest")
    t.join(10)
    assert not t.is_alive()


def test_command_with_wrong_token_is_refused(server: ControlServer, token: str) -> None:
    with connect_command(server.address, new_token()) as cli, pytest.raises(ControlTimeout):
        cli.request(StatusRequest(), timeout_ms=200)
    # The refused frame reaches the server when it next polls; on a busy machine that can take a while.
    deadline = time.monotonic() + 10
    while not server.rejected and time.monotonic() < deadline:
        assert server.poll(50) is None
    assert server.rejected == {"bad_token": 1}


def test_reply_rules(server: ControlServer, token: str) -> None:
    with connect_instance(server.address, "a", token) as c:
        c.send(Heartbeat(instance="a"))
        item = _recv(server)
        with pytest.raises(ValueError, match="only command requests"):
            server.reply(item, Result(ok=True))
    with connect_command(server.address, token) as cli:
        with pytest.raises(ControlTimeout):
            cli.request(StatusRequest(), timeout_ms=100)
        item = _recv(server)
        with pytest.raises(ValueError, match="not a reply"):
            server.reply(item, Finish(instance="a"))


def test_closed_server(run_dir: Path, token: str) -> None:
    for kind in ("zmq", "inproc"):
        s = open_server(control_address(kind, run_dir), token)  # type: ignore[arg-type]
        s.close()
        s.close()
        with pytest.raises(ControlError, match="closed"):
            s.poll(0)
    # The ipc socket files are gone and the address can be bound again.
    assert not (run_dir / "control.sock").exists()
    open_server(control_address("zmq", run_dir), token).close()


def test_inproc_specifics(token: str) -> None:
    addr = control_address("inproc")
    with pytest.raises(ControlError, match="no in-process control server"):
        connect_instance(addr, "a", token)
    with open_server(addr, token), pytest.raises(ControlError, match="already serves"):
        open_server(addr, token)


# ---- raw ZeroMQ peers that do not follow the protocol


def test_zmq_garbage_is_counted_not_fatal(run_dir: Path, token: str) -> None:
    addr = control_address("zmq", run_dir)
    ctx = zmq.Context()
    with open_server(addr, token) as server:
        raw = make_socket(ctx, zmq.DEALER, addr.instances, bind=False, identity=b"raw")
        forged = make_socket(ctx, zmq.DEALER, addr.instances, bind=False, identity=b"a")
        badid = make_socket(ctx, zmq.DEALER, addr.instances, bind=False, identity=b"\xff\x00bad")
        rawcli = make_socket(ctx, zmq.DEALER, addr.commands, bind=False)
        try:
            raw.send_multipart([token.encode()])
            raw.send_multipart([token.encode(), b"\xeenope"])
            raw.send_multipart([token.encode(), b"\x02{"])
            # a heartbeat whose body is not an InstanceStats (a count that is text)
            raw.send_multipart([token.encode(), b"\x04" + json.dumps({"instance": "raw", "stats": {"ok": "x"}}).encode()])
            raw.send_multipart(encode(Finish(instance="raw"), token.encode()))
            forged.send_multipart(encode(Heartbeat(instance="b"), token.encode()))
            badid.send_multipart(encode(Heartbeat(instance="x"), token.encode()))
            rawcli.send_multipart(encode(StatusRequest(), token.encode()))
            raw.send_multipart(encode(Heartbeat(instance="raw"), token.encode()))
            # The one valid message comes through; everything before it is dropped and counted. The
            # server may take a while on a busy machine: wait on the conditions, not a number of polls.
            deadline = time.monotonic() + REACT_S
            got = None
            while got is None and time.monotonic() < deadline:
                got = server.poll(200)
            assert got is not None and got.peer == "raw" and isinstance(got.msg, Heartbeat)
            while sum(server.rejected.values()) < 8 and time.monotonic() < deadline:
                assert server.poll(100) is None
            assert server.rejected == {"malformed": 4, "unknown_tag": 1, "wrong_direction": 1,
                                       "identity_mismatch": 1, "bad_identity": 1}
        finally:
            for s in (raw, forged, badid, rawcli):
                s.close(linger=0)
            ctx.term()


# ---- a real spawned instance process


def _child(environ: dict[str, str]) -> None:
    with connect_instance_from_env(environ) as c:
        c.send(Ready(instance=c.instance, pid=os.getpid()))
        msg = c.recv(20_000, setting="test")
        assert isinstance(msg, Shutdown)
        c.send(Ended(instance=c.instance, drained_count=0))


def test_spawned_instance(run_dir: Path, token: str) -> None:
    addr = control_address("zmq", run_dir)
    with open_server(addr, token) as server:
        env = instance_env(addr, "child-0", token)
        proc = mp.get_context("spawn").Process(target=_child, args=(env,), daemon=True)
        proc.start()
        try:
            item = server.recv(30_000, setting="test")
            assert isinstance(item.msg, Ready) and item.msg.pid == proc.pid and item.peer == "child-0"
            server.send("child-0", Shutdown(instance="child-0", drain=True))
            assert server.recv(30_000, setting="test").msg == Ended(instance="child-0", drained_count=0)
            proc.join(30)
            assert proc.exitcode == 0
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def test_env_helpers(token: str) -> None:
    addr = control_address("inproc")
    env = instance_env(addr, "x", token)
    assert set(env) == {control.ENV_ADDRESS, control.ENV_TOKEN, control.ENV_INSTANCE}
    with open_server(addr, token) as server, connect_instance_from_env(env) as c:
        c.send(Heartbeat(instance="x"))
        assert _recv(server).peer == "x"
    with pytest.raises(ControlError, match="GPUPRIMS_CONTROL_TOKEN"):
        connect_instance_from_env({control.ENV_ADDRESS: "a b", control.ENV_INSTANCE: "x"})
    with pytest.raises(ControlError, match="two addresses"):
        connect_instance_from_env({**env, control.ENV_ADDRESS: "queue://x/instances"})


def test_second_node_on_same_run_dir_refused(run_dir: Path, token: str) -> None:
    addr = control_address("zmq", run_dir)
    with open_server(addr, token), pytest.raises(ControlError, match="already serving"):
        open_server(addr, token)


def test_stale_socket_file_is_replaced(run_dir: Path, token: str) -> None:
    import socket as pysocket

    path = run_dir / "control.sock"
    with pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM) as s:
        s.bind(str(path))  # bound, never listening, then closed: a stale file
    assert path.exists()
    with open_server(control_address("zmq", run_dir), token) as server, \
            connect_instance(server.address, "a", token) as c:
        c.send(Heartbeat(instance="a"))
        assert _recv(server).peer == "a"


def test_late_reply_is_not_taken_for_the_next_request(server: ControlServer, token: str) -> None:
    with connect_command(server.address, token) as cli:
        with pytest.raises(ControlTimeout):
            cli.request(StatusRequest(), timeout_ms=100)
        first = _recv(server)
        server.reply(first, Result(ok=True, message="late"))
        t = _serve(server, 1)
        assert cli.request(StopRequest(drain=False), timeout_ms=REACT_S * 1000) == Result(ok=True, message="StopRequest")
        t.join(10)
        assert not t.is_alive()


def test_late_reply_arriving_while_the_cli_waits_is_skipped(server: ControlServer, token: str) -> None:
    # The stale reply reaches the CLI while it is already waiting for the next one: the socket turns
    # readable, the stale reply is discarded, and the CLI must go on waiting for its own.
    with connect_command(server.address, token) as cli:
        with pytest.raises(ControlTimeout):
            cli.request(StatusRequest(), timeout_ms=100)
        first = _recv(server)

        def late_then_real() -> None:
            second = server.poll(REACT_S * 1000)
            if second is None:
                return
            server.reply(first, Result(ok=True, message="late"))
            time.sleep(0.2)  # a window in which only the stale reply is there to read
            server.reply(second, Result(ok=True, message="real"))

        t = threading.Thread(target=late_then_real, daemon=True)
        t.start()
        assert cli.request(StopRequest(drain=False), timeout_ms=REACT_S * 1000) == Result(ok=True, message="real")
        t.join(REACT_S)
        assert not t.is_alive()
