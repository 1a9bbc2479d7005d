"""``gpuprims-fleet``: start a fleet from fleet.yaml, see its state, drain a machine, stop it.

The Ray cluster runs with token authentication (``RAY_AUTH_MODE=token``) and without the dashboard
(so without its Jobs API): ``start`` sets both before Ray starts, and the other commands present the
same token. With ``ray.address`` unset, ``start`` runs a local cluster for trying it (this machine
is one gpuprims machine) and serves until Ctrl-C; with an address it joins that cluster, starts the
detached controller there and returns.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
from pathlib import Path
from typing import Any

import click
import ray
from ray._raylet import AuthenticationTokenLoader
from ray._raylet import Config as RayConfig

from orchestrator.config.schema import ConfigError
from orchestrator.fleet.config import FleetConfig, load_fleet_config
from orchestrator.fleet.controller import NAMESPACE, controller_actor, find_controller

#: Where a local fleet keeps its Ray token (mode 0600) for the other commands.
TOKEN_FILE = Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache") / "gpuprims-fleet.token"


def secure_ray_env(token_file: str | None) -> None:
    """Token authentication on, and the token Ray should present: ``token_file`` (RAY_AUTH_TOKEN_PATH),
    else an existing RAY_AUTH_TOKEN, else a fresh one kept in :data:`TOKEN_FILE` (mode 0600)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    if token_file:
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(Path(token_file).expanduser())
    elif os.environ.get("RAY_AUTH_TOKEN"):
        pass
    elif TOKEN_FILE.exists():
        os.environ["RAY_AUTH_TOKEN"] = TOKEN_FILE.read_text().strip()
    else:
        TOKEN_FILE.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(32)
        fd = os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.environ["RAY_AUTH_TOKEN"] = token
    # Ray read its settings (the auth mode among them) when it was imported, before these were set:
    # read them again and drop any token it cached, or this process would start a cluster that wants
    # a token and then present none (what Ray 2.60's own test helper does between tests).
    RayConfig.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def connect(address: str | None, token_file: str | None) -> None:
    secure_ray_env(token_file)
    ray.init(address=address or "auto", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """A fleet of gpuprims nodes on a Ray cluster (docs/fleet.md)."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--address", default=None, help="Ray cluster to join (default: fleet.yaml ray.address, else local).")
def start(config: str, address: str | None) -> None:
    """Start the fleet described by CONFIG."""
    try:
        cfg = load_fleet_config(config)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    address = address or cfg.ray.address
    secure_ray_env(cfg.ray.token_file)
    if address:
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, logging_level="WARNING")
        controller_actor(cfg)
        click.echo(f"fleet controller started on {address}; `gpuprims-fleet status --address {address}`")
        return
    ray.init(namespace=NAMESPACE, include_dashboard=False, resources={cfg.ray.resource: 1},
             logging_level="WARNING", _system_config=cfg.ray.system_config())
    ctl = controller_actor(cfg)
    ray.get(ctl.ping.remote())
    gcs = ray.get_runtime_context().gcs_address
    click.echo(f"local fleet up at {gcs} (Ctrl-C stops it); `gpuprims-fleet status --address {gcs}` in another "
               "shell")
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    try:
        ray.get(ctl.shutdown.remote(), timeout=120)
    except (ray.exceptions.RayError, TimeoutError):  # already stopped (`gpuprims-fleet stop`)
        pass
    ray.shutdown()
    click.echo("local fleet stopped")


def _print_status(st: dict[str, Any]) -> None:
    click.echo(f"routing table version {st['routes']['version']}")
    click.echo("nodes:")
    for nid, n in st["nodes"].items():
        flags = [k for k in ("suspected", "draining") if n.get(k)] + ([] if n.get("alive") else ["dead"])
        click.echo(f"  {nid[:12]}  {n.get('host')}:udp {n.get('udp_port')} http {n.get('http_port')}  "
                   f"gpus {n.get('gpus')}  {' '.join(flags) or 'ok'}")
    click.echo("apps:")
    for name, a in st["apps"].items():
        p, s = a["primary"], a.get("standby")
        sb = f"standby {s['node'][:12]}/gpu{s['gpu']}" if s else "no standby"
        click.echo(f"  {name}: primary {p['node'][:12]}/gpu{p['gpu']} {p['instances']}x{p['gpu_pct']}%  {sb}")
    for name in st.get("pending", []):
        click.echo(f"  {name}: not placed")
    click.echo("machine events:")
    for d in st.get("node_events", [])[-10:]:
        click.echo(f"  {d['action']:<13} {str(d.get('node') or '-')[:12]:<12} {d['reason']}")
    click.echo("last decisions:")
    for d in st["decisions"][-10:]:
        click.echo(f"  {d['action']:<13} {d.get('app') or '-':<12} {d['reason']}")


@main.command()
@click.option("--address", default=None, help="Ray cluster (default: auto).")
@click.option("--token-file", default=None, help="Ray token file (default: the local fleet's).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(address: str | None, token_file: str | None, as_json: bool) -> None:
    """Nodes, apps, routes and the last decisions with their reasons."""
    st = _call(address, token_file, "status")
    click.echo(json.dumps(st, indent=2, default=str)) if as_json else _print_status(st)


@main.command()
@click.argument("node")
@click.option("--address", default=None)
@click.option("--token-file", default=None)
def drain(node: str, address: str | None, token_file: str | None) -> None:
    """Move every app off NODE (a node id or a prefix of one)."""
    click.echo(f"draining {_call(address, token_file, 'drain', node)}")


@main.command("set-gpu")
@click.argument("app")
@click.argument("gpu_pct", type=click.IntRange(1, 100))
@click.option("--address", default=None)
@click.option("--token-file", default=None)
def set_gpu(app: str, gpu_pct: int, address: str | None, token_file: str | None) -> None:
    """Change APP's share to GPU_PCT per instance on its primary and its standby (each node makes an
    Overlapped-Execution change: the app serves throughout)."""
    a = _call(address, token_file, "set_share", app, gpu_pct)
    where = " and ".join(f"{s['node'][:12]}/gpu{s['gpu']}" for s in (a["primary"], a.get("standby")) if s)
    click.echo(f"{app}: {a['primary']['instances']} x {gpu_pct}% on {where}; `gpuprims-fleet status` shows "
               "each node's `applied`")


@main.command()
@click.option("--address", default=None)
@click.option("--token-file", default=None)
def stop(address: str | None, token_file: str | None) -> None:
    """Stop every node's orchestrator and the controller."""
    _call(address, token_file, "shutdown")
    ray.kill(find_controller())
    click.echo("fleet stopped")


def _call(address: str | None, token_file: str | None, method: str, *args: Any) -> Any:
    try:
        connect(address, token_file)
        ctl = find_controller()
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise click.ClickException(f"no fleet reachable: {e}") from None
    try:
        return ray.get(getattr(ctl, method).remote(*args), timeout=120)
    except ray.exceptions.RayTaskError as e:
        raise click.ClickException(str(e.cause if hasattr(e, "cause") else e)) from None


__all__ = ["FleetConfig", "main"]

if __name__ == "__main__":
    main()
