"""`gpuprims-orchestrator`: start a node from apps.yaml, and talk to a running one."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import click

from orchestrator.config import ConfigError, load_config

log = logging.getLogger("gpuprims.cli")


def _find_run_dir(run_dir: str | None) -> Path:
    """The run dir to talk to: the one given, else the only live node of this user.

    With several nodes running it refuses to guess (a command for one must not reach another).
    """
    from orchestrator.control import runtime_base

    if run_dir:
        return Path(run_dir)
    base = runtime_base()
    live = sorted({p.parent.resolve() for p in base.glob("*/command.sock") if not p.parent.is_symlink()})
    if not live:
        raise click.ClickException(f"no running node found under {base}; pass --run-dir")
    if len(live) > 1:
        raise click.ClickException("several nodes are running (" + ", ".join(map(str, live)) +
                                   "); pass --run-dir to say which")
    return live[0]


def _known_models() -> set[str]:
    from apps.zoo.registry import ALIASES, MODELS

    return set(MODELS) | set(ALIASES)


def _command(run_dir: str | None, msg: object, timeout_ms: float) -> object:
    from orchestrator.control import ControlError, connect_command, control_address, read_token

    d = _find_run_dir(run_dir)
    try:
        token = read_token(d)
        with connect_command(control_address("zmq", d), token) as cli:
            return cli.request(msg, timeout_ms=timeout_ms)  # type: ignore[arg-type]
    except (ControlError, OSError) as e:
        raise click.ClickException(f"cannot reach the node in {d}: {e}") from e


@click.group()
def main() -> None:
    """Run a gpuprims node and operate it."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--ready-timeout", default=180.0, show_default=True, help="Seconds each instance may take to load.")
@click.option("--duration", type=float, default=None, help="Stop by itself after this many seconds.")
def start(config: str, ready_timeout: float, duration: float | None) -> None:
    """Start the node described by CONFIG and run until stopped (SIGINT/SIGTERM or `stop`)."""
    from orchestrator.logs import setup_logging
    from orchestrator.node import Node, StartError, install_signal_handlers

    try:
        cfg = load_config(config, known_models=_known_models())
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    setup_logging(cfg.node.log_level, cfg.node.log_format)
    monitor = None
    if cfg.node.autoscale:
        from orchestrator.monitor import Monitor

        monitor = Monitor()
    node = Node(cfg, ready_timeout_s=ready_timeout, monitor=monitor)
    install_signal_handlers(node)
    try:
        node.start()
    except StartError as e:
        raise click.ClickException(str(e)) from e
    try:
        node.serve(duration_s=duration)
    finally:
        node.stop(drain=True)
    log.info("node stopped")


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
def validate(config: str) -> None:
    """Check CONFIG and print the apps it defines, or say precisely what is wrong."""
    try:
        cfg = load_config(config, known_models=_known_models())
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    for app in cfg.apps:
        click.echo(f"{app.name}: app_id {app.app_id}, model {app.model}, slo {app.slo_ms} ms, "
                   f"gpu_pct {app.gpu_pct}, instances {app.instances}")
    click.echo(f"{config}: ok")


@main.command()
@click.option("--run-dir", default=None, help="The node's run directory (default: the last node started).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for the node.")
def status(run_dir: str | None, as_json: bool, timeout: float) -> None:
    """Print apps, instances, GPU%, rates, latency, SLO attainment and drops."""
    from orchestrator.messages import StatusRequest
    from orchestrator.metrics import format_status

    reply = _command(run_dir, StatusRequest(), timeout * 1000)
    st = reply.status  # type: ignore[attr-defined]
    click.echo(json.dumps(st, indent=1) if as_json else format_status(st))


@main.command()
@click.option("--run-dir", default=None, help="The node's run directory (default: the last node started).")
@click.option("--no-drain", is_flag=True, help="Do not wait for queued requests to be served.")
def stop(run_dir: str | None, no_drain: bool) -> None:
    """Stop the node gracefully (drains in-flight requests unless --no-drain)."""
    from orchestrator.messages import StopRequest

    reply = _command(run_dir, StopRequest(drain=not no_drain), 5000)
    click.echo(reply.message or "stopping")  # type: ignore[attr-defined]


@main.command("set-gpu")
@click.argument("app")
@click.argument("pct", type=click.IntRange(1, 100))
@click.option("--run-dir", default=None, help="The node's run directory (default: the last node started).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Follow the change through its phases until it is done or failed.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait for the change.")
def set_gpu(app: str, pct: int, run_dir: str | None, wait: bool, timeout: float) -> None:
    """Change APP's GPU% to PCT with Overlapped-Execution (no downtime, no lost request).

    The node accepts the change and carries it out in its own loop (pending, initialising, switched,
    draining, done or failed); with --wait (the default) this command shows each phase as it happens.
    """
    from orchestrator.messages import SetGpuRequest, StatusRequest

    reply = _command(run_dir, SetGpuRequest(app=app, gpu_pct=pct), 5000)
    click.echo(reply.message)  # type: ignore[attr-defined]
    if not reply.ok:  # type: ignore[attr-defined]
        sys.exit(1)
    change = (reply.data or {}).get("change") or {}  # type: ignore[attr-defined]
    if not wait or not change or change.get("phase") in ("done", "failed"):
        return
    deadline = time.monotonic() + timeout
    shown = 0
    while time.monotonic() < deadline:
        st = _command(run_dir, StatusRequest(), 5000).status  # type: ignore[attr-defined]
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
