"""`gpuprims-traffic`: generate, record, replay and measure gpuprims UDP request streams.

    gpuprims-traffic gen    --app 1:224x224x3:float32 -o requests.npz
    gpuprims-traffic pcap   --app 1:224x224x3:float32 --rate 100 --count 1000 --to 127.0.0.1:9000 -o s.pcap
    gpuprims-traffic replay --pcap s.pcap --rate 500 --loop 3 --json report.json --cdf cdf.png
    gpuprims-traffic replay --app 1:224x224x3:uint8,rate=200 --app 2:32x32x3:float32,pps=5e4 --duration 10
    gpuprims-traffic recv   --listen 127.0.0.1:40000 --pcap s.pcap --duration 5
    gpuprims-traffic echo   --listen 127.0.0.1:9000 --delay-us 500

Reports are JSON on stdout; progress goes to stderr. Ctrl-C prints the partial report (exit 130).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from gpuprims import __version__, wire
from gpuprims.interrupt import ctrl_c_interrupts
from gpuprims.traffic.echo import EchoServer
from gpuprims.traffic.pcap import PcapError, read_pcap, replay_plan, write_pcap
from gpuprims.traffic.receiver import Receiver, Tracker
from gpuprims.traffic.runner import run
from gpuprims.traffic.sender import SocketSet, parse_port_range
from gpuprims.traffic.stream import AppStream, PlanBuilder, Stream, parse_addr, read_intervals

_APP_KEYS = {"rate": float, "pps": float, "process": str, "count": int, "duration": float, "to": str,
             "image": str, "variants": int, "deadline_us": int, "chunk": int, "intervals": str}


def _shape(text: str) -> tuple[int, ...]:
    """'224x224x3' -> (224, 224, 3); '' is a scalar. ValueError for anything else."""
    return tuple(int(d) for d in text.lower().split("x")) if text.strip() else ()


def parse_tensors(spec: str, text: str) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """'NAME=SHAPE:DTYPE[;NAME=SHAPE:DTYPE...]' -> ((name, shape, dtype), ...). A name may hold spaces,
    dots, '=' and ':' (the last '=' ends it), not ';' or ','."""
    out = []
    for item in text.split(";"):
        name, eq, rest = item.rpartition("=")
        shape_s, colon, dtype = rest.partition(":")
        if not eq or not name or not colon or not dtype:
            raise click.BadParameter(f"{spec!r}: tensor {item!r} is not NAME=SHAPE:DTYPE (like image=3x224x224:float32)",
                                     param_hint="--app")
        try:
            shape = _shape(shape_s)
        except ValueError:
            raise click.BadParameter(f"{spec!r}: tensor {name!r}: SHAPE {shape_s!r} is not integers like 3x224",
                                     param_hint="--app") from None
        out.append((name, shape, dtype))
    return tuple(out)


def parse_app(spec: str, defaults: dict[str, Any]) -> AppStream:
    """'ID:SHAPE:DTYPE[,key=value,...]' (SHAPE like 224x224x3), or for a multi-tensor app
    'ID:tensors:NAME=SHAPE:DTYPE[;NAME=SHAPE:DTYPE...][,key=value,...]', with defaults for the keys not given."""
    head, *pairs = spec.split(",")
    tensors = None
    if head.split(":", 2)[1:2] == ["tensors"]:
        parts = head.split(":", 2)
        if len(parts) != 3:
            raise click.BadParameter(f"{spec!r}: expected ID:tensors:NAME=SHAPE:DTYPE[;...]", param_hint="--app")
        tensors = parse_tensors(spec, parts[2])
        parts = [parts[0], "1"]  # shape and dtype do not apply to a tensors body
    else:
        parts = head.split(":")
    if len(parts) not in (2, 3):
        raise click.BadParameter(f"{spec!r}: expected ID:SHAPE[:DTYPE][,key=value...] or "
                                 "ID:tensors:NAME=SHAPE:DTYPE[;...][,key=value...]", param_hint="--app")
    try:
        app_id = int(parts[0])
        shape = _shape(parts[1])
    except ValueError:
        raise click.BadParameter(f"{spec!r}: ID and SHAPE must be integers (SHAPE like 224x224x3)",
                                 param_hint="--app") from None
    dtype = parts[2] if len(parts) == 3 else defaults.get("dtype", "float32")
    opts = {k: v for k, v in defaults.items() if v is not None and k != "dtype"}
    own_timing = set()
    for pair in pairs:
        k, eq, v = pair.partition("=")
        k = k.strip().replace("-", "_")
        if not eq or k not in _APP_KEYS:
            raise click.BadParameter(f"{spec!r}: unknown key {k!r}; keys: {', '.join(_APP_KEYS)}", param_hint="--app")
        try:
            opts[k] = _APP_KEYS[k](v)
        except ValueError:
            raise click.BadParameter(f"{spec!r}: {k}={v!r} is not a {_APP_KEYS[k].__name__}", param_hint="--app") \
                from None
        own_timing.add(k)
    # A rate given in the spec replaces a default rate of the other kind.
    for a, b in (("rate", "pps"), ("pps", "rate"), ("rate", "intervals"), ("pps", "intervals"),
                 ("intervals", "rate"), ("intervals", "pps"), ("count", "duration"), ("duration", "count")):
        if a in own_timing and b not in own_timing:
            opts.pop(b, None)
    intervals = read_intervals(opts.pop("intervals")) if opts.get("intervals") else None
    opts.pop("intervals", None)
    try:
        return AppStream(app_id, shape, dtype, rate=opts.get("rate"), pps=opts.get("pps"),
                         process=opts.get("process", "constant"), count=opts.get("count"),
                         duration_s=opts.get("duration"), intervals_s=intervals,
                         to=parse_addr(opts.get("to", "127.0.0.1:9000")), image=opts.get("image", "astronaut"),
                         variants=opts.get("variants", 1), chunk_payload=opts.get("chunk", wire.DEFAULT_CHUNK_PAYLOAD),
                         deadline_us=opts.get("deadline_us", 0), tensors=tensors)
    except ValueError as e:
        raise click.BadParameter(f"{spec!r}: {e}", param_hint="--app") from None


def _stream_options(f):
    opts = [
        click.option("--app", "apps", multiple=True, metavar="ID:SHAPE[:DTYPE][,k=v...]",
                     help="An app's requests, e.g. 1:224x224x3:float32,rate=100,to=127.0.0.1:9001, or a "
                          "multi-tensor app's, e.g. '3:tensors:image in=3x5:float32;scale.k=1:int64'. Repeat for "
                          "several apps; keys: " + ", ".join(_APP_KEYS) + " (default to the options below)."),
        click.option("--rate", type=float, help="Requests/s (per app unless the app says otherwise)."),
        click.option("--pps", type=float, help="Packets/s; the request rate follows from packets per request."),
        click.option("--process", type=click.Choice(["constant", "poisson"]), default="constant", show_default=True,
                     help="Spacing of requests."),
        click.option("--intervals", type=click.Path(exists=True, dir_okay=False),
                     help="File of inter-request intervals (one a line; s, or with ns/us/ms/s suffix)."),
        click.option("--count", type=int, help="Requests per app (after warm-up)."),
        click.option("--duration", type=float, help="Seconds of sending (after warm-up)."),
        click.option("--warmup", type=float, default=0.0, show_default=True,
                     help="Seconds of warm-up before the measured requests; excluded from the report."),
        click.option("--to", "to", default="127.0.0.1:9000", show_default=True,
                     help="Destination HOST:PORT (for a pcap: overrides the captured destinations)."),
        click.option("--image", default="astronaut", show_default=True,
                     help="Sample image (skimage.data name) or image/.npy file for request bodies."),
        click.option("--variants", type=int, default=1, show_default=True,
                     help="Distinct request bodies per app (crops of the image), rotated."),
        click.option("--dtype", default="float32", show_default=True, help="Default dtype of --app specs."),
        click.option("--deadline-us", type=int, default=0, show_default=True, help="deadline_us of requests."),
        click.option("--chunk", type=int, default=wire.DEFAULT_CHUNK_PAYLOAD, show_default=True,
                     help="Payload bytes per datagram."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed (Poisson arrivals)."),
        click.option("--request-id-base", type=int, default=1, show_default=True, help="First request id."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _build_stream(kw: dict[str, Any], *, need_app: bool = True) -> Stream | None:
    if not kw["apps"]:
        if need_app:
            raise click.UsageError("give at least one --app (or --pcap for replay)")
        return None
    defaults = {"rate": kw["rate"], "pps": kw["pps"], "process": kw["process"], "count": kw["count"],
                "duration": kw["duration"], "to": kw["to"], "image": kw["image"], "variants": kw["variants"],
                "deadline_us": kw["deadline_us"], "chunk": kw["chunk"], "intervals": kw["intervals"],
                "dtype": kw["dtype"]}
    apps = [parse_app(s, defaults) for s in kw["apps"]]
    try:
        return Stream(apps, seed=kw["seed"], warmup_s=kw["warmup"], request_id_base=kw["request_id_base"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _emit(doc: dict, json_path: str | None) -> None:
    text = json.dumps(doc, indent=1)
    if json_path:
        Path(json_path).write_text(text + "\n")
    click.echo(text)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "--version", prog_name="gpuprims-traffic")
def main() -> None:
    """Generate, record, replay and measure gpuprims UDP request streams."""


@main.command()
@_stream_options
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the request tensors (.npz).")
def gen(output: str | None, **kw: Any) -> None:
    """Make request bodies for apps from real image bytes; print what they are."""
    if kw["rate"] is None and kw["pps"] is None and kw["intervals"] is None:
        kw["rate"] = 1.0  # timing is irrelevant here
    if kw["count"] is None and kw["duration"] is None:
        kw["count"] = 1
    stream = _build_stream(kw)
    assert stream is not None
    out: dict[str, Any] = {"apps": []}
    arrays = {}
    for app in stream.apps:
        bodies = app.bodies()
        for v, b in enumerate(bodies):
            arrays[f"app{app.app_id}_v{v}"] = b
        if app.tensors is not None:  # each body is a TENSORS body; say what it holds
            out["apps"].append({"app_id": app.app_id, "dtype": "tensors", "variants": len(bodies),
                                "tensors": [{"name": n, "shape": list(sh), "dtype": dt} for n, sh, dt in app.tensors],
                                "body_bytes": app.body_bytes, "packets_per_request": app.packets_per_request})
            continue
        out["apps"].append({"app_id": app.app_id, "shape": list(app.shape), "dtype": app.dtype,
                            "image": app.image, "variants": len(bodies), "body_bytes": app.body_bytes,
                            "packets_per_request": app.packets_per_request,
                            "min": float(bodies[0].min()), "max": float(bodies[0].max())})
    if output:
        np.savez(output, **arrays)
        out["output"] = output
    _emit(out, None)


@main.command("pcap")
@_stream_options
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="pcap file to write.")
@click.option("--src", default="127.0.0.1", show_default=True, help="Source IPv4 address of the frames.")
@click.option("--src-ports", default="40000", show_default=True, help="Source port or LOW-HIGH range (per request in turn).")
@click.option("--nanosecond", is_flag=True, help="Nanosecond timestamps (pcap magic a1b23c4d).")
@click.option("--src-mac", default="02:00:00:00:00:01", show_default=True, help="Source MAC of the frames.")
@click.option("--dst-mac", default="00:00:00:00:00:00", show_default=True,
              help="Destination MAC (the default is lo's, so tcpreplay -i lo delivers the frames).")
def pcap_cmd(output: str, src: str, src_ports: str, nanosecond: bool, src_mac: str, dst_mac: str,
             **kw: Any) -> None:
    """Write an app stream as an Ethernet/IPv4/UDP pcap, timestamped by its schedule."""
    stream = _build_stream(kw)
    assert stream is not None
    try:
        res = write_pcap(output, stream.plan(), src_ip=src, sports=parse_port_range(src_ports), nanosecond=nanosecond,
                         src_mac=src_mac, dst_mac=dst_mac)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    _emit(res, None)


@main.command()
@_stream_options
@click.option("--pcap", "pcap_path", type=click.Path(dir_okay=False), help="Replay this pcap/pcapng.")
@click.option("--speed", type=float, default=1.0, show_default=True,
              help="pcap timing multiplier (when no --rate/--pps is given).")
@click.option("--loop", "loops", type=int, default=1, show_default=True, help="Replay the pcap N times.")
@click.option("--raw", is_flag=True, help="Send pcap datagrams that are not valid requests as they are.")
@click.option("--skip-foreign", is_flag=True, help="Skip pcap frames that are not UDP/IPv4 instead of failing.")
@click.option("--ports", default=None, help="Client port or LOW-HIGH range (one socket each; requests in turn).")
@click.option("--bind", default="127.0.0.1", show_default=True, help="Client address to bind.")
@click.option("--timeout", type=float, default=1.0, show_default=True,
              help="Seconds after which an answer counts as late.")
@click.option("--linger", type=float, default=None, help="Seconds to wait for answers after the last send "
              "(default 1.5 x timeout).")
@click.option("--slo-ms", type=float, default=None, help="Latency SLO for the attainment figure.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report here.")
@click.option("--samples", "samples_path", type=click.Path(dir_okay=False),
              help="Write raw per-request samples (.npz).")
@click.option("--cdf", "cdf_path", type=click.Path(dir_okay=False), help="Write a latency CDF plot (.png).")
@click.option("--timeline", "timeline_path", type=click.Path(dir_okay=False), help="Write a timeline plot (.png).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@click.option("--gso/--no-gso", default=True, show_default=True, help="UDP GSO (many datagrams per message).")
@click.option("--batch", type=int, default=1024, show_default=True, help="Most packets per send batch.")
def replay(pcap_path: str | None, speed: float, loops: int, raw: bool, skip_foreign: bool, ports: str | None,
           bind: str, timeout: float, linger: float | None, slo_ms: float | None, json_path: str | None,
           samples_path: str | None, cdf_path: str | None, timeline_path: str | None, progress: bool, gso: bool,
           batch: int, **kw: Any) -> None:
    """Send a pcap or generated stream at a rate, receive the answers, and report (JSON)."""
    try:
        if pcap_path:
            if kw["apps"]:
                raise click.UsageError("give --pcap or --app, not both")
            cap = read_pcap(pcap_path, skip_foreign=skip_foreign)
            to = kw["to"] if _given("to") else None
            plan = replay_plan(cap, to=to, rate=kw["rate"], pps=kw["pps"], process=kw["process"], speed=speed,
                               loops=loops, count=kw["count"], duration_s=kw["duration"], seed=kw["seed"], raw=raw,
                               warmup_s=kw["warmup"])
        else:
            stream = _build_stream(kw)
            assert stream is not None
            plan = stream.plan()
        port_list = parse_port_range(ports)
    except PcapError as e:
        raise click.ClickException(str(e)) from None
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        with ctrl_c_interrupts():
            report = run(plan, ports=port_list, bind_host=bind, timeout_s=timeout, linger_s=linger, slo_ms=slo_ms,
                         progress=progress, gso=gso, max_batch_pkts=batch)
    except OSError as e:  # a client port in use, an address not on this host
        raise click.ClickException(str(e)) from None
    s = report.summary
    rate = s["rate"]
    if rate.get("achieved") is False:
        tgt = rate["target_pps"] or rate["target_rps"]
        unit = "packets/s" if rate["target_pps"] else "requests/s"
        got = rate["achieved_pps"] if rate["target_pps"] else rate["achieved_rps"]
        click.echo(f"gpuprims-traffic: target rate NOT achieved: {got:,.0f} of {tgt:,.0f} {unit} "
                   f"({100 * got / tgt:.1f}%)", err=True)
    if samples_path:
        np.savez_compressed(samples_path, **report.samples)
    if cdf_path:
        report.plot_cdf(cdf_path)
    if timeline_path:
        report.plot_timeline(timeline_path)
    _emit(report.to_dict(), json_path)
    if report.interrupted:
        click.echo("gpuprims-traffic: interrupted; the report above is partial", err=True)
        sys.exit(130)


def _given(name: str) -> bool:
    ctx = click.get_current_context()
    return ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)


@main.command()
@click.option("--listen", "listen", multiple=True, required=True, help="HOST:PORT to receive answers on (repeat).")
@click.option("--pcap", "pcap_path", type=click.Path(exists=True, dir_okay=False),
              help="The requests that were sent (e.g. by tcpreplay), to match answers against.")
@click.option("--duration", type=float, default=None, help="Most seconds to listen (default: until Ctrl-C; with "
              "--pcap it also stops once every request is answered or --idle passes).")
@click.option("--idle", type=float, default=2.0, show_default=True,
              help="With --pcap: stop after this many seconds without a datagram once one has come.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report here.")
def recv(listen: tuple[str, ...], pcap_path: str | None, duration: float | None, idle: float,
         json_path: str | None) -> None:
    """Receive answers to requests sent by something else (tcpreplay) and count them."""
    addrs = [parse_addr(a) for a in listen]
    plan = None
    if pcap_path:
        try:
            plan = replay_plan(read_pcap(pcap_path, skip_foreign=True), raw=True)
        except PcapError as e:
            raise click.ClickException(str(e)) from None
    try:
        owned = SocketSet([p for _, p in addrs], addrs[0][0])
    except OSError as e:  # a port in use, an address not on this host
        raise click.ClickException(str(e)) from None
    with owned as socks, ctrl_c_interrupts():
        if plan is None:
            plan = _empty_plan()
        tracker = Tracker(plan, np.zeros(plan.n_events, np.int64), timeout_ns=2**62)
        rx = Receiver(socks.sockets)
        rx.start()
        click.echo("listening on " + ", ".join(f"{h}:{p}" for h, p in socks.addresses), err=True)
        t0 = time.monotonic()
        last_seen = t0
        interrupted = False
        try:
            while True:
                time.sleep(0.02)
                recs, payload = rx.drain()
                tracker.feed(recs, payload)
                now = time.monotonic()
                if len(recs):
                    last_seen = now
                if duration is not None and now - t0 >= duration:
                    break
                if pcap_path and tracker.datagrams and (
                        tracker.outstanding() == 0 or now - last_seen >= idle):
                    break
        except KeyboardInterrupt:
            interrupted = True
        rx.stop()
        recs, payload = rx.drain()
        tracker.feed(recs, payload)
        st = rx.stats()
    req = plan.ev_app >= 0
    answered = int(((tracker.state != 0) & req).sum())
    status: dict[str, int] = {}
    for v in tracker.status[(tracker.state != 0) & req].tolist():
        name = wire.Status(v).name if v <= max(wire.Status) else f"STATUS_{v}"
        status[name] = status.get(name, 0) + 1
    doc = {"listen": [f"{h}:{p}" for h, p in addrs], "pcap": pcap_path, "datagrams": st["datagrams"],
           "requests": int(req.sum()) if pcap_path else None, "answered": answered if pcap_path else None,
           "not_answered": int(req.sum()) - answered if pcap_path else None,
           "duplicates": tracker.duplicates(), "unmatched": tracker.unmatched, "status": status,
           "invalid": tracker.invalid, "socket_drops": st["socket_drops"], "interrupted": interrupted,
           "note": "latency needs the sender's clock: use `replay`, which sends and receives"}
    _emit(doc, json_path)
    if interrupted:
        sys.exit(130)


def _empty_plan():
    b = PlanBuilder()
    return b.build(ev_time_ns=np.zeros(0, np.int64), ev_unit=np.zeros(0, np.uint32), ev_rid=np.zeros(0, np.uint64),
                   ev_dest=np.zeros(0, np.uint16), ev_app=np.zeros(0, np.int32), ev_warmup=np.zeros(0, bool),
                   span_ns=0)


@main.command()
@click.option("--listen", default="127.0.0.1:9000", show_default=True, help="HOST:PORT to serve on.")
@click.option("--delay-us", type=float, default=0.0, show_default=True, help="Hold each answer this long.")
@click.option("--status", type=click.Choice([s.name for s in wire.Status]), default="OK", show_default=True)
@click.option("--response-bytes", type=int, default=16, show_default=True, help="Body bytes of each answer.")
@click.option("--drop-every", type=int, default=0, help="Drop every n-th answer.")
@click.option("--duplicate-every", type=int, default=0, help="Answer every n-th request twice.")
@click.option("--spin-us", type=float, default=0.0, help="Spin this long before an answer is due (precision).")
def echo(listen: str, delay_us: float, status: str, response_bytes: int, drop_every: int, duplicate_every: int,
         spin_us: float) -> None:
    """Answer gpuprims requests on loopback after a delay (a stand-in node for tests)."""
    host, port = parse_addr(listen)
    try:
        srv = EchoServer(host, port, delay_s=delay_us / 1e6, status=wire.Status[status], response_bytes=response_bytes,
                         drop_every=drop_every, duplicate_every=duplicate_every, spin_us=spin_us,
                         stamp=response_bytes >= 16)
    except OSError as e:
        raise click.ClickException(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    click.echo(f"echo server on {srv.address[0]}:{srv.address[1]} (Ctrl-C to stop)", err=True)
    try:
        with ctrl_c_interrupts():
            srv.serve()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    c = srv.counters
    _emit({"datagrams": c.datagrams, "requests": c.requests, "responses": c.responses, "invalid": c.invalid,
           "dropped": c.dropped}, None)


if __name__ == "__main__":  # pragma: no cover
    main()
