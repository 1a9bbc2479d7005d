"""The `gpuprims-orchestrator` commands that only talk to a running node: ``status``, ``stop``, ``set-gpu``.

They are control-socket clients: they find the node's run directory, read its token and send one
request (or a few). This module imports only what that takes (click, the control plane with pyzmq,
the messages, the run-directory records and the status formatter), never the node, the config
schema, the front door, numpy or torch, so these commands start in a fraction of a second; the
group in `orchestrator.cli.main` loads it only when one of them runs (tests/orchestrator/cli/test_cli_control.py
holds the import list). ``start`` and ``validate`` live in `orchestrator.cli.node`.

Which node: ``status`` and ``set-gpu`` without ``--run-dir``/``--name`` act on the only live node;
``stop`` always wants one of them. Every command first removes what dead nodes left behind and says so.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from orchestrator.control import channel as control
from orchestrator.control.channel import ControlError, connect_command, control_address, read_token
from orchestrator.control.messages import Message, SetGpuRequest, StatusReply, StatusRequest, StopRequest
from orchestrator.control.records import NodeView
from orchestrator.control.rundir import (
    NodeEntry,
    Removed,
    find_nodes,
    node_state,
    read_record,
    reap,
    reap_dead,
)
from orchestrator.control.status_format import format_status

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RUN_DIR_HELP = "The node's run directory."
NAME_HELP = "The node's name (its run directory under the runtime base); see `start --name`."


def runtime_base() -> Path:
    """Where named nodes live (``$XDG_RUNTIME_DIR/gpuprims`` or ``/tmp/gpuprims-<uid>``)."""
    return control.runtime_base()  # looked up at call time: tests point it at a private directory


def named_dir(name: str) -> Path:
    """The run directory of the node called ``name``; a name that is not one is a usage error."""
    if not _NAME_RE.fullmatch(name) or name == "current":
        raise click.BadParameter(f"{name!r}: a node name is 1-64 letters, digits, '.', '_' or '-' (not 'current')",
                                 param_hint="--name")
    return runtime_base() / name


def echo_removed(removed: Removed) -> None:
    """Say on stderr what was removed after a dead node."""
    click.echo(f"gpuprims-orchestrator: {removed.describe()}", err=True)


def sweep_dead() -> list[NodeEntry]:
    """Clean up after dead nodes of this user (saying what was removed); the nodes still alive."""
    entries = find_nodes(runtime_base())
    for r in reap_dead(entries):
        echo_removed(r)
    return [e for e in entries if e.state == "live"]


def _which(live: list[NodeEntry]) -> str:
    return "\n".join(f"  --name {e.run_dir.name}: {e.describe()}" for e in live)


def find_run_dir(run_dir: str | None, name: str | None = None, *, must_name: bool = False) -> Path:
    """The run dir to talk to: the one given (``--run-dir`` or ``--name``), else the only live node.

    With several nodes running, or with ``must_name`` (stop), it refuses to guess and lists them.
    A dead node found on the way is cleaned up (and said); naming a dead one is an error.
    """
    if run_dir and name:
        raise click.UsageError("give --run-dir or --name, not both")
    if run_dir or name:
        d = Path(run_dir).expanduser().absolute() if run_dir else named_dir(name or "")
        state = node_state(d) if d.is_dir() else "empty"
        if state == "starting":
            raise click.ClickException(f"the node in {d} has not opened its command socket (it is starting, "
                                       "or died while starting: `start` on this run dir cleans up after it)")
        if state == "dead":
            removed = reap(d)
            echo_removed(removed)
            raise click.ClickException(f"the node in {d} is not running (it died; what it left is removed)")
        if state == "empty":
            raise click.ClickException(f"no node is running in {d}")
        return d
    live = sweep_dead()
    if not live:
        raise click.ClickException(f"no running node found under {runtime_base()}")
    if must_name:
        raise click.ClickException("say which node to stop with --name (or --run-dir):\n" + _which(live))
    if len(live) > 1:
        raise click.ClickException("several nodes are running; say which with --name (or --run-dir):\n"
                                   + _which(live))
    return live[0].run_dir


def command(d: Path, msg: Message, timeout_ms: float) -> Any:
    """Send one request to the node in ``d`` and return its reply; an unreachable node is a one-line error."""
    try:
        token = read_token(d)
        with connect_command(control_address("zmq", d), token) as cli:
            return cli.request(msg, timeout_ms=timeout_ms)
    except (ControlError, OSError) as e:
        raise click.ClickException(f"cannot reach the node in {d}: {e}") from e


@click.command()
@click.option("--run-dir", default=None, help=RUN_DIR_HELP)
@click.option("--name", default=None, help=NAME_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for the node.")
def status(run_dir: str | None, name: str | None, as_json: bool, timeout: float) -> None:
    """Print apps, instances, GPU%, rates, latency, SLO attainment and drops."""
    d = find_run_dir(run_dir, name)
    reply = command(d, StatusRequest(), timeout * 1000)
    if not isinstance(reply, StatusReply):
        raise click.ClickException(f"the node in {d} answered the status request with a {type(reply).__name__}, "
                                   "not a status (is it a gpuprims node of this version?)")
    if as_json:
        click.echo(json.dumps(reply.status, indent=1))
        return
    click.echo(format_status(status_view(d, reply.status)))


def status_view(d: Path, body: object) -> NodeView:
    """A status reply's body as a view; a malformed or foreign one is a one-line error naming what is wrong."""
    try:
        return NodeView.from_dict(body)
    except ValueError as e:
        raise click.ClickException(f"the node in {d} sent a status this CLI cannot read "
                                   f"(a node of another version?): {e}") from e


@click.command()
@click.option("--run-dir", default=None, help=RUN_DIR_HELP)
@click.option("--name", default=None, help=NAME_HELP)
@click.option("--no-drain", is_flag=True, help="Do not wait for queued requests to be served.")
@click.option("--no-wait", is_flag=True, help="Return once the node accepted the stop, without waiting for it.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the node to stop.")
def stop(run_dir: str | None, name: str | None, no_drain: bool, no_wait: bool, timeout: float) -> None:
    """Stop the node gracefully (drains in-flight requests unless --no-drain) and wait until it has."""
    d = find_run_dir(run_dir, name, must_name=True)
    rec = read_record(d)
    t0 = time.monotonic()
    command(d, StopRequest(drain=not no_drain), 5000)
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


@click.command("set-gpu")
@click.argument("app")
@click.argument("pct", type=click.IntRange(1, 100))
@click.option("--run-dir", default=None, help=RUN_DIR_HELP)
@click.option("--name", default=None, help=NAME_HELP)
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Follow the change through its phases until it is done or failed.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait for the change.")
def set_gpu(app: str, pct: int, run_dir: str | None, name: str | None, wait: bool, timeout: float) -> None:
    """Change APP's GPU% to PCT with Overlapped-Execution (no downtime, no lost request).

    The node accepts the change and carries it out in its own loop (pending, initialising, switched,
    draining, done or failed); with --wait (the default) this command shows each phase as it happens.
    """
    d = find_run_dir(run_dir, name)
    reply = command(d, SetGpuRequest(app=app, gpu_pct=pct), 5000)
    click.echo(reply.message)
    if not reply.ok:
        sys.exit(1)
    change = (reply.data or {}).get("change") or {}
    if not wait or not change or change.get("phase") in ("done", "failed"):
        return
    deadline = time.monotonic() + timeout
    shown = 0
    while time.monotonic() < deadline:
        st = command(d, StatusRequest(), 5000).status
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
