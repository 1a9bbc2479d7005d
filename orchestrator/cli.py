"""`gpuprims-orchestrator`: start a node from apps.yaml, and talk to a running one.

Every node has a name: ``start --name NAME`` runs it in ``<runtime base>/NAME``; without one the
name is its fresh run directory's (``run-xxxxxxxx``). ``status`` and ``set-gpu`` act on the only
live node when no ``--run-dir``/``--name`` is given; ``stop`` always wants one of them. Every command
first removes what dead nodes (an orchestrator that was killed) left behind and says so.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from apps.zoo.names import known_names
from gpuprims import __version__
from gpuprims.backend import resolve_backend
from orchestrator import control
from orchestrator.config import ConfigError, NodeConfig, engine_problems, load_config
from orchestrator.control import (
    ControlError,
    connect_command,
    control_address,
    make_run_dir,
    read_token,
)
from orchestrator.logs import setup_logging
from orchestrator.messages import SetGpuRequest, StatusRequest, StopRequest
from orchestrator.monitor import Monitor
from orchestrator.node import Node, StartError, install_signal_handlers
from orchestrator.overflow import NodeOverflow, OverflowSetupError
from orchestrator.rundir import (
    NodeEntry,
    NodeRecord,
    RunDirBusy,
    claim,
    find_nodes,
    node_state,
    read_record,
    reap,
    reap_dead,
    update_record,
)
from orchestrator.status_format import format_status

log = logging.getLogger("gpuprims.cli")

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _runtime_base() -> Path:
    return control.runtime_base()  # looked up at call time: tests point it at a private directory


def _named_dir(name: str) -> Path:
    if not _NAME_RE.fullmatch(name) or name == "current":
        raise click.BadParameter(f"{name!r}: a node name is 1-64 letters, digits, '.', '_' or '-' (not 'current')",
                                 param_hint="--name")
    return _runtime_base() / name


def _echo_removed(removed: Any) -> None:
    click.echo(f"gpuprims-orchestrator: {removed.describe()}", err=True)


def _sweep_dead() -> list[NodeEntry]:
    """Clean up after dead nodes of this user; the nodes still alive."""
    entries = find_nodes(_runtime_base())
    for r in reap_dead(entries):
        _echo_removed(r)
    return [e for e in entries if e.state == "live"]


def _which(live: list[NodeEntry]) -> str:
    return "\n".join(f"  --name {e.run_dir.name}: {e.describe()}" for e in live)


def _find_run_dir(run_dir: str | None, name: str | None = None, *, must_name: bool = False) -> Path:
    """The run dir to talk to: the one given (``--run-dir`` or ``--name``), else the only live node.

    With several nodes running, or with ``must_name`` (stop), it refuses to guess and lists them.
    A dead node found on the way is cleaned up (and said); naming a dead one is an error.
    """
    if run_dir and name:
        raise click.UsageError("give --run-dir or --name, not both")
    if run_dir or name:
        d = Path(run_dir).expanduser().absolute() if run_dir else _named_dir(name or "")
        state = node_state(d) if d.is_dir() else "empty"
        if state == "starting":
            raise click.ClickException(f"the node in {d} has not opened its command socket (it is starting, "
                                       "or died while starting: `start` on this run dir cleans up after it)")
        if state == "dead":
            removed = reap(d)
            _echo_removed(removed)
            raise click.ClickException(f"the node in {d} is not running (it died; what it left is removed)")
        if state == "empty":
            raise click.ClickException(f"no node is running in {d}")
        return d
    live = _sweep_dead()
    if not live:
        raise click.ClickException(f"no running node found under {_runtime_base()}")
    if must_name:
        raise click.ClickException("say which node to stop with --name (or --run-dir):\n" + _which(live))
    if len(live) > 1:
        raise click.ClickException("several nodes are running; say which with --name (or --run-dir):\n"
                                   + _which(live))
    return live[0].run_dir


def _check_user_models(cfg: NodeConfig, source: str) -> None:
    """A ``module:factory`` model whose module cannot be found is refused before anything starts."""
    specs = [(f"apps[{i}].model", a.model) for i, a in enumerate(cfg.apps) if a.model]
    specs += [(f"apps[{i}].stages[{j}].model", s.model) for i, a in enumerate(cfg.apps)
              for j, s in enumerate(a.stages or ()) if s.model]
    for key, spec in specs:
        if ":" not in spec:
            continue
        module = spec.split(":", 1)[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as e:  # a missing parent package
            found, why = False, str(e)
        else:
            why = f"no module named {module!r}"
        if not found:
            raise click.ClickException(f"{source}: {key}: cannot import the user model {spec!r}: {why} "
                                       "(is it on PYTHONPATH?)")


def _check_engines(cfg: NodeConfig, source: str) -> None:
    """Every app's engine runs on the backend this node would use (``backend: auto`` resolved here the
    way start resolves it; an explicit backend was checked when the file was read)."""
    if cfg.node.backend != "auto" or all(eng.kind == "eager" for a in cfg.apps for _, eng in a.engines()):
        return
    try:
        backend = resolve_backend("auto", isolated=True)
    except (RuntimeError, ValueError) as e:
        raise click.ClickException(f"{source}: node.backend: {e}") from e
    problems = engine_problems(cfg, backend)
    if problems:
        raise click.ClickException(str(ConfigError(source, problems)))


def _command(run_dir: str | None, msg: object, timeout_ms: float, *, name: str | None = None,
             d: Path | None = None) -> object:
    d = d or _find_run_dir(run_dir, name)
    try:
        token = read_token(d)
        with connect_command(control_address("zmq", d), token) as cli:
            return cli.request(msg, timeout_ms=timeout_ms)  # type: ignore[arg-type]
    except (ControlError, OSError) as e:
        raise click.ClickException(f"cannot reach the node in {d}: {e}") from e


def _port_in_use(e: BaseException) -> str | None:
    """The one line to print for an address-in-use failure anywhere in ``e``'s chain, else None."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.EADDRINUSE:
            return str(seen)
        if "address already in use" in str(seen).lower():
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return None


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="gpuprims-orchestrator")
def main() -> None:
    """Run a gpuprims node and operate it."""


_RUN_DIR_HELP = "The node's run directory."
_NAME_HELP = "The node's name (its run directory under the runtime base); see `start --name`."


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--name", default=None, help="Name the node (run dir <runtime base>/NAME); default: its run dir's name.")
@click.option("--run-dir", default=None, help="Run directory (default: node.run_dir of CONFIG, else a fresh one).")
@click.option("--ready-timeout", default=180.0, show_default=True, help="Seconds each instance may take to load.")
@click.option("--duration", type=float, default=None, help="Stop by itself after this many seconds.")
def start(config: str, name: str | None, run_dir: str | None, ready_timeout: float, duration: float | None) -> None:
    """Start the node described by CONFIG and run until stopped (SIGINT/SIGTERM or `stop`)."""
    if run_dir and name:
        raise click.UsageError("give --run-dir or --name, not both")
    try:
        cfg = load_config(config, known_models=known_names())
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    _check_user_models(cfg, config)
    setup_logging(cfg.node.log_level, cfg.node.log_format)
    _sweep_dead()
    if name:
        target: Path | None = _named_dir(name)
    elif run_dir or cfg.node.run_dir:
        target = Path(run_dir or cfg.node.run_dir or "").expanduser().absolute()
    else:
        target = None
    created = target is None or not target.exists()
    d = make_run_dir(target) if target is not None else Path(tempfile.mkdtemp(prefix="run-", dir=_runtime_base()))
    rec = NodeRecord.for_this_process(config=str(Path(config).absolute()), name=name or d.name)
    try:
        removed = claim(d, rec)
    except RunDirBusy as e:
        raise click.ClickException(str(e)) from None
    if removed is not None:
        _echo_removed(removed)
    cfg = cfg.model_copy(update={"node": cfg.node.model_copy(update={"run_dir": str(d)})})
    monitor = None
    if cfg.node.autoscale:
        monitor = Monitor()
    node = Node(cfg, ready_timeout_s=ready_timeout, monitor=monitor)
    install_signal_handlers(node)
    try:
        try:
            node.start()
        except StartError as e:
            raise click.ClickException(str(e)) from None
        except Exception as e:
            why = _port_in_use(e)
            if why is None:
                raise
            raise click.ClickException(f"cannot start: {why}") from None
        urls = {f"udp:{p}": f"udp://{cfg.node.listen.host}:{p}" for p in node.ingest.ports}  # type: ignore[union-attr]
        if node.metrics is not None:
            node.metrics.update(node.status())  # ready from now on, not from the first control-loop pass
            base = node.metrics.url.rsplit("/", 1)[0]
            for path in getattr(node.metrics, "paths", ("/metrics",)):
                urls[path.strip("/").replace("/", "_")] = base + path
        update_record(d, ports=list(node.ingest.ports), urls=urls,  # type: ignore[union-attr]
                      shm=[node.pool.name.lstrip("/")])  # type: ignore[union-attr]
        log.info("node %s up (pid %d, run dir %s)", rec.name, os.getpid(), d)
        for key, url in urls.items():
            log.info("  %-8s %s", key, url)
        log.info("stop it with: gpuprims-orchestrator stop --%s", f"name {rec.name}" if d.parent == _runtime_base()
                 else f"run-dir {d}")
        node.serve(duration_s=duration)
    finally:
        node.stop(drain=True)
        _release(d, created)
    log.info("node stopped")


def _release(d: Path, created: bool) -> None:
    """After the node stopped: remove its record, and the run dir if this command created it."""
    with contextlib.suppress(OSError):
        (d / "node.json").unlink()
    if created:
        shutil.rmtree(d, ignore_errors=True)


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
def validate(config: str) -> None:
    """Check CONFIG and print the apps it defines, or say precisely what is wrong."""
    try:
        cfg = load_config(config, known_models=known_names())
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    _check_user_models(cfg, config)
    _check_engines(cfg, config)
    try:  # CPU overflow: every pool fits the cores and has the CPU profile it routes by
        overflow = NodeOverflow.plan(cfg)
    except OverflowSetupError as e:
        raise click.ClickException(f"{config}: {e}") from e
    for app in cfg.apps:
        pool = overflow.pools.get(app.name) if overflow is not None else None
        click.echo(f"{app.name}: app_id {app.app_id}, model {app.model}, slo {app.slo_ms} ms, "
                   f"gpu_pct {app.gpu_pct}, instances {app.instances}"
                   + (f", CPU overflow on cores {','.join(map(str, pool.cores))}" if pool is not None else ""))
    click.echo(f"{config}: ok")


@main.command()
@click.option("--run-dir", default=None, help=_RUN_DIR_HELP)
@click.option("--name", default=None, help=_NAME_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for the node.")
def status(run_dir: str | None, name: str | None, as_json: bool, timeout: float) -> None:
    """Print apps, instances, GPU%, rates, latency, SLO attainment and drops."""
    reply = _command(run_dir, StatusRequest(), timeout * 1000, name=name)
    st = reply.status  # type: ignore[attr-defined]
    click.echo(json.dumps(st, indent=1) if as_json else format_status(st))


@main.command()
@click.option("--run-dir", default=None, help=_RUN_DIR_HELP)
@click.option("--name", default=None, help=_NAME_HELP)
@click.option("--no-drain", is_flag=True, help="Do not wait for queued requests to be served.")
@click.option("--no-wait", is_flag=True, help="Return once the node accepted the stop, without waiting for it.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the node to stop.")
def stop(run_dir: str | None, name: str | None, no_drain: bool, no_wait: bool, timeout: float) -> None:
    """Stop the node gracefully (drains in-flight requests unless --no-drain) and wait until it has."""
    d = _find_run_dir(run_dir, name, must_name=True)
    rec = read_record(d)
    t0 = time.monotonic()
    _command(None, StopRequest(drain=not no_drain), 5000, d=d)
    who = rec.describe() if rec is not None else str(d)
    if no_wait:
        click.echo(f"stopping {who}")
        return
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        gone = rec.alive is False if rec is not None else not (d / "command.sock").exists()
        if gone:
            click.echo(f"stopped {who} in {time.monotonic() - t0:.1f} s")
            return
        time.sleep(0.1)
    raise click.ClickException(f"{who} accepted the stop but is still running after {timeout:g} s (--timeout)")


@main.command("set-gpu")
@click.argument("app")
@click.argument("pct", type=click.IntRange(1, 100))
@click.option("--run-dir", default=None, help=_RUN_DIR_HELP)
@click.option("--name", default=None, help=_NAME_HELP)
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Follow the change through its phases until it is done or failed.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait for the change.")
def set_gpu(app: str, pct: int, run_dir: str | None, name: str | None, wait: bool, timeout: float) -> None:
    """Change APP's GPU% to PCT with Overlapped-Execution (no downtime, no lost request).

    The node accepts the change and carries it out in its own loop (pending, initialising, switched,
    draining, done or failed); with --wait (the default) this command shows each phase as it happens.
    """
    d = _find_run_dir(run_dir, name)
    reply = _command(run_dir, SetGpuRequest(app=app, gpu_pct=pct), 5000, d=d)
    click.echo(reply.message)  # type: ignore[attr-defined]
    if not reply.ok:  # type: ignore[attr-defined]
        sys.exit(1)
    change = (reply.data or {}).get("change") or {}  # type: ignore[attr-defined]
    if not wait or not change or change.get("phase") in ("done", "failed"):
        return
    deadline = time.monotonic() + timeout
    shown = 0
    while time.monotonic() < deadline:
        st = _command(run_dir, StatusRequest(), 5000, d=d).status  # type: ignore[attr-defined]
        now = next((c for c in st.get("changes", {}).get("recent", []) if c["id"] == change["id"]), None)
        if now is None:
            click.echo(f"change {change['id']} is no longer known to the node", err=True)
            sys.exit(1)
        for phase, at_s in now["phases"][shown:]:
            click.echo(f"  {at_s:8.3f} s  {phase}")
        shown = len(now["phases"])
        if now["phase"] == "done":
            click.echo(f"{app} now at {pct}%")
            return
        if now["phase"] == "failed":
            click.echo(f"change failed: {now['error']}", err=True)
            sys.exit(1)
        time.sleep(0.2)
    click.echo(f"change {change['id']} still {now['phase']} after {timeout:.0f} s (--timeout)", err=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
