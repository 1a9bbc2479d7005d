"""bench/flood: the node's memory under a flood of oversized bodies (issue 27 item 8), against a real node.

A node is started as a user starts it (``python -m orchestrator.cli.main start``) from the example apps
(examples/apps.yaml's ``classify`` and ``detect``, ``engine: eager`` so it starts fast, no shadow) in a
private runtime directory, on loopback, with its UDP ingest, HTTP and gRPC front door. Its resident
memory (VmRSS, and the peak VmHWM, from /proc/<pid>/status) is read idle, then during four floods,
one after the other, each of four concurrent clients:

- ``http_expect``: a declared ``Content-Length`` of ``--body-mb`` MB to /v2/models/classify/infer with
  ``Expect: 100-continue`` (what curl sends for a large body): the client waits up to 1 s for
  ``100 Continue`` or an answer, as curl does, then streams the body;
- ``http_length``: the same without ``Expect``: the client streams the body at once;
- ``http_chunked``: ``Transfer-Encoding: chunked``, no length declared;
- ``grpc``: a ``ModelInfer`` message of ``--body-mb`` MB over a grpcio channel whose send limit allows it.

HTTP bodies are streamed from one 64 KiB piece (no client builds a body in memory); the gRPC message is
serialised once and the same bytes are sent by all four calls. The node's RSS is sampled every
``--sample-ms`` ms throughout, by a process of its own (the clients never delay a reading). Per client: the answer (HTTP status, gRPC code), the bytes it pushed
into its socket before the refusal (HTTP only: gRPC's library does the sending), and the time from
its first byte to the refusal. Before and after the floods one normal request goes over every
transport (UDP client, HTTP JSON, gRPC); the node must answer each after the flood with the same
logits as before it.

The issue's report (before the bound): the node went from 278 MB to 1.17 GB before each 200 MB body
was refused; both figures are in the summary beside ours.

    python -m bench.flood [--quick] [--body-mb 200] [--out-dir DIR]

Reports, never asserts a figure; it exits 1 with the reason (and the node reaped) only when the node
could not be started or stopped cleanly.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.common import load_note, write_result
from gpuprims.client import Client
from orchestrator.frontdoor import oip_pb2

ROOT = Path(__file__).resolve().parent.parent
APP, APP_ID, SHAPE = "classify", 1, (3, 64, 64)
#: The issue's report before the bound (issue 27 item 8): node RSS idle and at its peak, in MB.
BEFORE_IDLE_MB, BEFORE_PEAK_MB = 278.0, 1170.0
FLOODS = ("http_expect", "http_length", "http_chunked", "grpc")
PATHS = ("udp", "http", "grpc")
CLIENTS = 4
PIECE = b"7" * (64 << 10)
#: How long curl waits for ``100 Continue`` before it sends the body anyway.
EXPECT_WAIT_S = 1.0
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"

CONFIG = """
node:
  listen: {{host: 127.0.0.1, port: 0}}
  backend: cpu
  http_port: {http}
  grpc_port: {grpc}
  pool: {{slot_count: 4096, max_payload: 1024, max_chunks: 64}}
apps:
  - {{name: classify, model: mobilenet_v2, seed: 0, input_shape: [3, 64, 64], dtype: float32, slo_ms: 200,
     gpu_pct: 50, max_batch: 4, max_wait_ms: 5, engine: eager, app_id: 1}}
  - {{name: detect, model: resnet18, input_shape: [3, 64, 64], dtype: uint8, slo_ms: 300, gpu_pct: 50,
     max_batch: 4, max_wait_ms: 5, engine: eager, app_id: 2}}
"""


def proc_kb(pid: int, key: str) -> int | None:
    """``key`` (VmRSS, VmHWM) of /proc/<pid>/status in KiB, or None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def free_port() -> int:
    """A TCP port on loopback nobody listens on now (the node binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The sampler's own process (so the flood's clients in this one never delay a reading): VmRSS of argv[1]
#: every argv[2] seconds, kept in memory, until its stdin closes; then "<monotonic s> <KiB>" lines.
SAMPLER = """
import select, sys, time
pid, interval_s = int(sys.argv[1]), float(sys.argv[2])
got = []
print("ready", flush=True)
while not select.select([sys.stdin], [], [], interval_s)[0]:
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(line.split()[1] for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        break
    got.append(f"{time.monotonic()} {kb}")
print("\\n".join(got))
"""


class Sampler:
    """Reads the node's VmRSS every ``interval_s`` in a process of its own: (seconds since start, KiB) pairs."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, int]] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Sampler:
        self._proc = subprocess.Popen([sys.executable, "-c", SAMPLER, str(self.pid), str(self.interval_s)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            self._proc.kill()
            self._proc.wait()
            raise RuntimeError("the RSS sampler did not start")
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        try:
            out, _ = self._proc.communicate(timeout=60)  # closing its stdin stops it
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        for line in out.splitlines():
            t, kb = line.split()
            self.samples.append((round(float(t) - self.t0, 4), int(kb)))


# --- HTTP ---------------------------------------------------------------------------------------------


def _read_answer(sock: socket.socket, timeout_s: float) -> int | None:
    """The status code of the HTTP answer on ``sock`` (skipping ``100 Continue``), or None if none came."""
    sock.setblocking(True)
    sock.settimeout(timeout_s)
    data = b""
    try:
        while True:
            while b"\r\n\r\n" not in data:
                more = sock.recv(65536)
                if not more:
                    break
                data += more
            if b"\r\n\r\n" not in data:
                break
            head, _, data = data.partition(b"\r\n\r\n")
            code = int(head.split()[1])
            if code != 100:
                return code
    except (OSError, ValueError, IndexError):
        pass
    return None


def _stream_until_answered(sock: socket.socket, chunked: bool, body_bytes: int, deadline: float) -> int:
    """Stream the body (``body_bytes`` on the wire, chunk framing included) from one piece until the server
    answers, closes, or the body ends; the bytes sent. A partial send resumes mid-piece, so chunk framing
    stays whole."""
    sent = 0
    piece = memoryview((b"%x\r\n" % len(PIECE)) + PIECE + b"\r\n" if chunked else PIECE)
    off = 0  # where in ``piece`` the next send starts
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    sock.setblocking(False)
    try:
        while sent < body_bytes and time.monotonic() < deadline:
            events = sel.select(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if any(mask & selectors.EVENT_READ for _, mask in events):
                return sent  # the answer (or the close) came while the body was on its way
            if any(mask & selectors.EVENT_WRITE for _, mask in events):
                try:
                    n = sock.send(piece[off:off + min(len(piece) - off, body_bytes - sent)])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:  # the server closed its side: it answered and stopped reading
                    return sent
                sent, off = sent + n, (off + n) % len(piece)
        if chunked and sent >= body_bytes and off == 0 and time.monotonic() < deadline:
            try:
                sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass
        return sent
    finally:
        sel.close()


def _continue_or_answer(sock: socket.socket, deadline: float) -> bool:
    """After a head with ``Expect: 100-continue``, as curl does: wait up to EXPECT_WAIT_S for an answer;
    True (send the body) on ``100 Continue`` (consumed) or silence, False when a final answer came."""
    ready, _, _ = select.select([sock], [], [], EXPECT_WAIT_S)
    if not ready:
        return True
    sock.settimeout(max(0.1, deadline - time.monotonic()))
    head = b""
    while b"\r\n\r\n" not in head and time.monotonic() < deadline:
        more = sock.recv(4096, socket.MSG_PEEK)
        if not more or more == head:  # closed, or nothing new yet
            if not more:
                return False
            time.sleep(0.001)
        head = more
    if not head.startswith((b"HTTP/1.1 100", b"HTTP/1.0 100")):
        return False  # a final answer (413): the body is not sent
    sock.recv(head.index(b"\r\n\r\n") + 4)
    return True


def http_flood_one(host: str, port: int, mode: str, body_bytes: int, timeout_s: float) -> dict[str, Any]:
    """One oversized HTTP request (``mode`` one of http_expect, http_length, http_chunked), as a client sees it."""
    headers = {"Host": f"{host}:{port}", "Content-Type": "application/json"}
    if mode == "http_chunked":
        headers["Transfer-Encoding"] = "chunked"
    else:
        headers["Content-Length"] = str(body_bytes)
    if mode == "http_expect":
        headers["Expect"] = "100-continue"
    head = "\r\n".join([f"POST /v2/models/{APP}/infer HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())])
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    sent = 0
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall((head + "\r\n\r\n").encode())
        go = True
        if mode == "http_expect":
            go = _continue_or_answer(sock, deadline)
        if go:
            sent = _stream_until_answered(sock, mode == "http_chunked", body_bytes, deadline)
        code = _read_answer(sock, max(1.0, deadline - time.monotonic()))
    return {"mode": mode, "answer": code, "sent_bytes": sent, "refused_s": round(time.perf_counter() - t0, 4)}


# --- gRPC ---------------------------------------------------------------------------------------------


def grpc_request(x: np.ndarray) -> bytes:
    """A serialised ModelInfer request for ``classify`` carrying ``x`` as raw FP32 bytes, NORMAL_BUDGET_US to answer."""
    req = oip_pb2.ModelInferRequest(model_name=APP)
    req.parameters["timeout"].int64_param = NORMAL_BUDGET_US
    t = req.inputs.add()
    t.name, t.datatype = "input", "FP32"
    t.shape.extend(x.shape)
    req.raw_input_contents.append(np.ascontiguousarray(x, np.float32).tobytes())
    return req.SerializeToString()


def oversized_grpc_request(body_bytes: int) -> bytes:
    """A serialised ModelInfer request of about ``body_bytes``: rows of ``classify``'s input, far past max_batch."""
    row = int(np.prod(SHAPE)) * 4
    rows = max(1, body_bytes // row)
    req = oip_pb2.ModelInferRequest(model_name=APP)
    t = req.inputs.add()
    t.name, t.datatype = "input", "FP32"
    t.shape.extend([rows, *SHAPE])
    req.raw_input_contents.append(bytes(rows * row))
    return req.SerializeToString()


def grpc_channel(target: str, max_send_bytes: int) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[("grpc.max_send_message_length", max_send_bytes),
                                                  ("grpc.max_receive_message_length", 64 << 20)])


def grpc_flood_one(channel: grpc.Channel, message: bytes, timeout_s: float) -> dict[str, Any]:
    """One oversized ModelInfer call; the code it ended with (RESOURCE_EXHAUSTED expected) and when."""
    call = channel.unary_unary(GRPC_METHOD)  # bytes in, bytes out: the message is serialised once
    t0 = time.perf_counter()
    try:
        call(message, timeout=timeout_s)
        code = "OK"
        detail = ""
    except grpc.RpcError as e:
        code = e.code().name if e.code() is not None else "UNKNOWN"
        detail = (e.details() or "")[:200]
    return {"mode": "grpc", "answer": code, "detail": detail, "sent_bytes": None,
            "message_bytes": len(message), "refused_s": round(time.perf_counter() - t0, 4)}


# --- normal requests ----------------------------------------------------------------------------------


#: Tries of a normal request per transport: on a busy machine one may miss its SLO (DEADLINE_MISSED), which
#: says nothing about memory; a transport fails the check only when every try fails.
ATTEMPTS = 3
#: The budget a normal request asks for (wire ``deadline_us``, OIP parameter ``timeout``): the check is
#: whether the node still answers, and correctly, not how fast it does on a shared machine.
NORMAL_BUDGET_US = 5_000_000


def _udp_logits(udp: tuple[str, int], x: np.ndarray, timeout_s: float) -> list[float]:
    with Client(udp, timeout_s=timeout_s) as c:
        r = c.infer(APP_ID, x[0], deadline_us=NORMAL_BUDGET_US)
    if not r.ok or r.output is None:
        raise RuntimeError(f"status {r.status.name}")
    return [float(v) for v in r.output.reshape(-1)]


def _http_logits(http_addr: tuple[str, int], x: np.ndarray, timeout_s: float) -> list[float]:
    body = json.dumps({"parameters": {"timeout": NORMAL_BUDGET_US},
                       "inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.reshape(-1).tolist()}]}).encode()
    conn = http.client.HTTPConnection(*http_addr, timeout=timeout_s)
    try:
        conn.request("POST", f"/v2/models/{APP}/infer", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        doc = json.loads(resp.read())
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}: {doc}")
    return [float(v) for v in doc["outputs"][0]["data"]]


def _grpc_logits(grpc_target: str, x: np.ndarray, timeout_s: float) -> list[float]:
    with grpc_channel(grpc_target, 64 << 20) as ch:
        try:
            raw = ch.unary_unary(GRPC_METHOD)(grpc_request(x), timeout=timeout_s)
        except grpc.RpcError as e:
            raise RuntimeError(f"{e.code()}: {e.details()}") from None
    resp = oip_pb2.ModelInferResponse.FromString(raw)
    return [float(v) for v in np.frombuffer(resp.raw_output_contents[0], np.float32)]


def normal_requests(udp: tuple[str, int], http_addr: tuple[str, int], grpc_target: str, x: np.ndarray,
                    timeout_s: float) -> dict[str, Any]:
    """One ``classify`` request per transport (up to ATTEMPTS tries each): per transport its logits (a
    list) or its last error (a string), and the tries it took (``<transport>_attempts``)."""
    calls: dict[str, Callable[[], list[float]]] = {
        "udp": partial(_udp_logits, udp, x, timeout_s), "http": partial(_http_logits, http_addr, x, timeout_s),
        "grpc": partial(_grpc_logits, grpc_target, x, timeout_s)}
    out: dict[str, Any] = {}
    for path, call in calls.items():
        for k in range(1, ATTEMPTS + 1):
            try:
                out[path] = call()
            except Exception as e:  # reported as that transport's failure, never raised
                out[path] = f"error {e}"
            out[f"{path}_attempts"] = k
            if isinstance(out[path], list):
                break
    return out


def same_answers(before: dict[str, Any], after: dict[str, Any], tol: float = 1e-4) -> dict[str, bool]:
    """Per transport: it answered after the flood with the logits it gave before (and UDP gave)."""
    ref = before.get("udp")
    ok: dict[str, bool] = {}
    for path in PATHS:
        got, want = after.get(path), before.get(path)
        ok[path] = (isinstance(got, list) and isinstance(want, list) and isinstance(ref, list)
                    and len(got) == len(want) == len(ref)
                    and bool(np.allclose(got, want, atol=tol, rtol=tol))
                    and bool(np.allclose(got, ref, atol=tol, rtol=tol)))
    return ok


# --- the run ------------------------------------------------------------------------------------------


def _concurrently(fn: Callable[[], dict[str, Any]], n: int, join_s: float) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            r = fn()
        except Exception as e:  # a client that broke is a reply of its own kind, not a lost one
            r = {"answer": f"client error {e!r}", "sent_bytes": None, "refused_s": None}
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    for t in threads:
        if t.is_alive():
            results.append({"answer": "no answer (client still waiting)", "sent_bytes": None, "refused_s": None})
    return results


def _wait_up(log_path: Path, node: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Wait until the node says it is up; its UDP ingest port."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text()
        if "node flood up" in text:
            m = re.search(r"udp://127\.0\.0\.1:(\d+)", text)
            if m:
                return int(m.group(1))
        if node.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the node did not come up within {timeout_s:g} s (--ready-timeout): {text[-3000:]}")
        time.sleep(0.2)


def run(body_bytes: int, sample_s: float, timeout_s: float, ready_timeout_s: float) -> dict[str, Any]:
    """Start a node, flood it, check it still answers, stop it; the summary and the raw samples."""
    x = np.random.default_rng(0).random((1, *SHAPE), dtype=np.float32)
    message = oversized_grpc_request(body_bytes)
    with tempfile.TemporaryDirectory(prefix="gpuprims-flood-") as tmp:
        xdg = Path(tmp) / "xdg"
        xdg.mkdir(mode=0o700)
        http_port, grpc_port = free_port(), free_port()
        cfg = Path(tmp) / "apps.yaml"
        cfg.write_text(CONFIG.format(http=http_port, grpc=grpc_port))
        env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg), "PYTHONUNBUFFERED": "1"}
        log_path = Path(tmp) / "node.log"
        with log_path.open("w") as log:
            node = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "start", "--name", "flood", str(cfg)],
                                    env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            try:
                udp_port = _wait_up(log_path, node, ready_timeout_s)
                udp, http_addr = ("127.0.0.1", udp_port), ("127.0.0.1", http_port)
                grpc_target = f"127.0.0.1:{grpc_port}"
                before = normal_requests(udp, http_addr, grpc_target, x, timeout_s)
                time.sleep(1.0)  # a few control-loop passes after the first requests
                idle_kb, idle_hwm_kb = proc_kb(node.pid, "VmRSS") or 0, proc_kb(node.pid, "VmHWM") or 0
                floods: dict[str, Any] = {}
                with Sampler(node.pid, sample_s) as sampler:
                    for mode in FLOODS:
                        t_start = time.monotonic() - sampler.t0
                        if mode == "grpc":
                            with grpc_channel(grpc_target, len(message) + (1 << 20)) as ch:
                                replies = _concurrently(partial(grpc_flood_one, ch, message, timeout_s),
                                                        CLIENTS, timeout_s * 2)
                        else:
                            replies = _concurrently(partial(http_flood_one, *http_addr, mode, body_bytes, timeout_s),
                                                    CLIENTS, timeout_s * 2)
                        floods[mode] = {"start_s": round(t_start, 4),
                                        "end_s": round(time.monotonic() - sampler.t0, 4), "replies": replies}
                samples = list(sampler.samples)  # complete once the sampler has stopped
                after = normal_requests(udp, http_addr, grpc_target, x, timeout_s)
                hwm_kb = proc_kb(node.pid, "VmHWM") or 0
                end_kb = proc_kb(node.pid, "VmRSS") or 0
                stop = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "stop", "--name", "flood"], env=env,
                                      cwd=ROOT, capture_output=True, text=True, timeout=120)
                node.wait(timeout=60)
                if stop.returncode != 0:
                    raise RuntimeError(f"orchestrator.cli.main stop failed ({stop.returncode}): {stop.stderr[-2000:]}")
            finally:
                if node.poll() is None:
                    node.kill()
                    node.wait()
    return summarise(body_bytes, idle_kb, idle_hwm_kb, hwm_kb, end_kb, samples, floods, before, after)


def summarise(body_bytes: int, idle_kb: int, idle_hwm_kb: int, hwm_kb: int, end_kb: int,
              samples: list[tuple[float, int]], floods: dict[str, Any], before: dict[str, Any],
              after: dict[str, Any]) -> dict[str, Any]:
    """The flat summary (BENCH.md) of one run, and the raw samples it was computed from."""
    mb = 1 / 1024
    peak_kb = max([idle_kb, *(kb for _, kb in samples)])
    summary: dict[str, Any] = {
        "body_mb": round(body_bytes / 1e6, 1), "clients_per_flood": CLIENTS,
        "rss_mb_idle": round(idle_kb * mb, 1), "rss_mb_peak_sampled": round(peak_kb * mb, 1),
        "rss_mb_growth": round((peak_kb - idle_kb) * mb, 1),
        "hwm_mb_idle": round(idle_hwm_kb * mb, 1), "hwm_mb_after": round(hwm_kb * mb, 1),
        "hwm_mb_growth": round((hwm_kb - idle_hwm_kb) * mb, 1), "rss_mb_end": round(end_kb * mb, 1),
        "rss_samples": len(samples),
        # The sampler's real interval (the machine may delay it), beside the one asked for; VmHWM catches
        # a peak between two readings.
        "rss_sample_interval_ms_median": (round(float(np.median(np.diff([t for t, _ in samples]))) * 1e3, 2)
                                          if len(samples) > 1 else None),
        "rss_sample_gap_ms_max": (round(float(np.max(np.diff([t for t, _ in samples]))) * 1e3, 2)
                                  if len(samples) > 1 else None),
        "before_fix_rss_mb_idle": BEFORE_IDLE_MB, "before_fix_rss_mb_peak": BEFORE_PEAK_MB,
        "before_fix_rss_mb_growth": BEFORE_PEAK_MB - BEFORE_IDLE_MB,
    }
    refusal = {"http_expect": 413, "http_length": 413, "http_chunked": 413, "grpc": "RESOURCE_EXHAUSTED"}
    all_refused = True
    for mode, f in floods.items():
        replies = f["replies"]
        codes = [r["answer"] for r in replies]
        in_flood = [kb for t, kb in samples if f["start_s"] <= t <= f["end_s"]]
        summary[f"{mode}.answers"] = codes
        summary[f"{mode}.all_refused"] = len(codes) == CLIENTS and all(c == refusal[mode] for c in codes)
        all_refused = all_refused and summary[f"{mode}.all_refused"]
        sent = [r["sent_bytes"] for r in replies if r.get("sent_bytes") is not None]
        if sent:
            summary[f"{mode}.sent_mb_max"] = round(max(sent) / 1e6, 2)
            summary[f"{mode}.sent_mb_each"] = [round(s / 1e6, 2) for s in sent]
        times = [r["refused_s"] for r in replies if r.get("refused_s") is not None]
        if times:
            summary[f"{mode}.refused_s_max"] = max(times)
            summary[f"{mode}.refused_s_median"] = round(float(np.median(times)), 4)
        if in_flood:
            summary[f"{mode}.rss_mb_peak"] = round(max(in_flood) * mb, 1)
    summary["all_refused"] = all_refused
    answered = same_answers(before, after)
    summary.update({f"after.{p}_ok": v for p, v in answered.items()})
    summary.update({f"after.{p}_attempts": after.get(f"{p}_attempts") for p in PATHS})
    summary["after_all_ok"] = all(answered.values())
    errors = {f"{when}.{p}": got[p] for when, got in (("before", before), ("after", after)) for p in PATHS
              if isinstance(got.get(p), str)}
    if errors:
        summary["transport_errors"] = errors
    raw = {"rss_kb": samples, "floods": floods,
           "normal_logits": {"before": before, "after": after}}
    return {"summary": summary, "samples": raw}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 MB bodies instead of 200 MB")
    ap.add_argument("--body-mb", type=float, default=None, help="size of each oversized body, MB (default 200)")
    ap.add_argument("--sample-ms", type=float, default=5.0, help="how often the node's RSS is read")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds a client waits for its answer")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds the node may take to start")
    ap.add_argument("--name", default="flood", help="result file stem")
    ap.add_argument("--out-dir", type=Path, default=None, help="directory for the JSON (default bench/results/<machine>/)")
    args = ap.parse_args(argv)
    body_mb = args.body_mb if args.body_mb is not None else (20.0 if args.quick else 200.0)
    if body_mb <= 0:
        ap.error(f"--body-mb must be positive, got {body_mb:g}")
    if args.sample_ms <= 0:
        ap.error(f"--sample-ms must be positive, got {args.sample_ms:g}")
    load_before = os.getloadavg()
    try:
        res = run(int(body_mb * 1e6), args.sample_ms / 1e3, args.timeout, args.ready_timeout)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:  # said in one line, the node reaped
        ap.exit(1, f"bench.flood: {e}\n")
    notes = ("node RSS from /proc/<pid>/status; the before_fix_* figures are the issue's report (issue 27 item 8), "
             "not measured here." + load_note(load_before))
    path = write_result("flood", "cpu", res["summary"], res["samples"], notes=notes, load_avg_before=load_before,
                        name=args.name, out_dir=args.out_dir)
    print(path)
    for k, v in res["summary"].items():
        print(f"{k:>28}: {v}")


if __name__ == "__main__":
    main()
