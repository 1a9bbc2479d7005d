"""The `gpuprims-orchestrator` commands that read a config: ``start`` (runs the node) and ``validate``.

They import the node, the config schema, the CPU overflow planner and the zoo's names (pydantic,
numpy, the front door's aiohttp and grpc), which is why they live apart from the control-socket
clients in `orchestrator.cli.control`: the group in `orchestrator.cli.main` loads this module only when
one of these two commands runs.

Every node has a name: ``start --name NAME`` runs it in ``<runtime base>/NAME``; without one the
name is its fresh run directory's (``run-xxxxxxxx``).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import click

from apps.zoo.names import known_names
from gpuprims.backend import resolve_backend
from orchestrator.cli.control import echo_removed, named_dir, runtime_base, sweep_dead
from orchestrator.config.schema import (
    ConfigError,
    NodeConfig,
    engine_problems,
    is_loopback,
    load_config,
    parse_config,
)
from orchestrator.control.channel import ControlError, make_run_dir
from orchestrator.control.logs import setup_logging
from orchestrator.control.rundir import NodeRecord, RunDirBusy, claim, update_record
from orchestrator.node.cpu_overflow import NodeOverflow, OverflowSetupError
from orchestrator.node.monitor import Monitor
from orchestrator.node.node import Node, StartError, install_signal_handlers

log = logging.getLogger("gpuprims.cli")


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


#: The node a bare ``start --model-repository DIR`` runs: Triton's ports on loopback, UDP beside them.
REPOSITORY_DEFAULTS: dict[str, Any] = {"listen": {"host": "127.0.0.1", "port": 9000}, "http_port": 8000,
                                       "grpc_port": 8001}


def _load(config: str | None, model_repository: str | None, load_models: tuple[str, ...] = (),
          control_mode: str | None = None, security: dict[str, Any] | None = None) -> tuple[NodeConfig, str]:
    """The node's config and the name to give it in messages: CONFIG (its node.model_repository replaced
    by ``model_repository`` when given), or, without CONFIG, a node of :data:`REPOSITORY_DEFAULTS` serving
    ``model_repository``; in explicit mode with the repository API (``node.repository.enabled``) on.
    ``security`` (:func:`_security`) replaces CONFIG's node.tls / node.auth."""
    extra: dict[str, Any] = dict(security or {})
    if model_repository is not None:
        extra["model_repository"] = str(Path(model_repository).expanduser().absolute())
    if control_mode is not None:
        extra["model_control_mode"] = control_mode
    if load_models:
        extra["load_models"] = list(load_models)
        extra.setdefault("model_control_mode", "explicit")
    if config is None:
        if model_repository is None:
            raise click.UsageError("give CONFIG (an apps.yaml), --model-repository DIR, or both")
        source = f"--model-repository {model_repository}"
        node: dict[str, Any] = {**REPOSITORY_DEFAULTS, **extra}
        if node.get("model_control_mode") == "explicit":
            # Explicit mode means models are loaded by name at run time: the repository API is what does it.
            node["repository"] = {"enabled": True}
        try:
            return parse_config({"node": node, "apps": []}, source=source), source
        except ConfigError as e:
            raise click.ClickException(str(e)) from e
    if load_models and model_repository is None:
        raise click.UsageError("--load-model needs --model-repository (or node.model_repository in CONFIG)")
    try:
        cfg = load_config(config, known_models=known_names(), node_overrides=extra or None)
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    return _explicit_repository_api(cfg, config), config


def _explicit_repository_api(cfg: NodeConfig, source: str) -> NodeConfig:
    """``cfg`` with ``node.repository.enabled`` on when it serves a model repository in explicit mode (the
    repository API is how a model is loaded by name), keeping its token settings; a ClickException naming
    the key to set when the API cannot be served (no ``node.http_port``; not loopback and no token)."""
    n = cfg.node
    if n.model_repository is None or n.model_control_mode != "explicit" or n.repository.enabled:
        return cfg
    if not n.http_port:
        raise click.ClickException(f"{source}: node.model_control_mode explicit loads models through the repository "
                                   "API on the HTTP front door; set node.http_port (0 is off)")
    if not n.repository.has_token and not is_loopback(n.listen.host):
        raise click.ClickException(f"{source}: node.model_control_mode explicit serves the repository API, which "
                                   f"loads code into the node; on {n.listen.host!r} (not loopback) set "
                                   "node.repository.token_file or token_env")
    # The checks above are NodeSettings' own for repository.enabled, so the copy needs no second validation.
    repo = n.repository.model_copy(update={"enabled": True})
    return cfg.model_copy(update={"node": n.model_copy(update={"repository": repo})})


def _security(tls_cert: str | None, tls_key: str | None, tls_ca: str | None, token_file: str | None) -> dict[str, Any]:
    """The node keys start's --tls-* and --token-file set (node.tls, node.auth), checked as a whole."""
    out: dict[str, Any] = {}
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together (the certificate and its private key)")
    if tls_ca is not None and tls_cert is None:
        raise click.UsageError("--tls-ca (require client certificates) needs --tls-cert and --tls-key")
    if tls_cert is not None:
        out["tls"] = {"cert": tls_cert, "key": tls_key, **({"ca": tls_ca} if tls_ca is not None else {})}
    if token_file is not None:
        out["auth"] = {"token_file": token_file}
    return out


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


@click.command()
@click.argument("config", type=click.Path(dir_okay=False), required=False)
@click.option("--model-repository", "model_repository", type=click.Path(file_okay=False, exists=True), default=None,
              help="Serve every model of this Triton model repository (with CONFIG: replaces its node.model_repository).")
@click.option("--model-control-mode", type=click.Choice(["none", "explicit", "poll"]), default=None,
              help="Which repository models load (Triton's: none = all, explicit = --load-model only).")
@click.option("--load-model", "load_models", multiple=True,
              help="With --model-control-mode explicit: a repository model to load (repeatable).")
@click.option("--name", default=None, help="Name the node (run dir <runtime base>/NAME); default: its run dir's name.")
@click.option("--run-dir", default=None, help="Run directory (default: node.run_dir of CONFIG, else a fresh one).")
@click.option("--ready-timeout", default=180.0, show_default=True, help="Seconds each instance may take to load.")
@click.option("--duration", type=float, default=None, help="Stop by itself after this many seconds.")
@click.option("--tls-cert", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Serve HTTPS and gRPC over TLS with this PEM certificate (chain) (node.tls.cert).")
@click.option("--tls-key", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The certificate's PEM private key (node.tls.key).")
@click.option("--tls-ca", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Require client certificates signed by this PEM CA (node.tls.ca).")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Inference needs 'Authorization: Bearer <the token in this file>' (node.auth.token_file).")
def start(config: str | None, model_repository: str | None, model_control_mode: str | None,
          load_models: tuple[str, ...], name: str | None, run_dir: str | None, ready_timeout: float,
          duration: float | None, tls_cert: str | None, tls_key: str | None, tls_ca: str | None,
          token_file: str | None) -> None:
    """Start the node described by CONFIG (and/or serving --model-repository DIR) and run until stopped
    (SIGINT/SIGTERM or `stop`)."""
    if run_dir and name:
        raise click.UsageError("give --run-dir or --name, not both")
    cfg, config = _load(config, model_repository, load_models, model_control_mode,
                        _security(tls_cert, tls_key, tls_ca, token_file))
    _check_user_models(cfg, config)
    setup_logging(cfg.node.log_level, cfg.node.log_format)
    sweep_dead()
    if name:
        target: Path | None = named_dir(name)
    elif run_dir or cfg.node.run_dir:
        target = Path(run_dir or cfg.node.run_dir or "").expanduser().absolute()
    else:
        target = None
    created = target is None or not target.exists()
    d = make_run_dir(target) if target is not None else Path(tempfile.mkdtemp(prefix="run-", dir=runtime_base()))
    rec = NodeRecord.for_this_process(config=str(Path(config).absolute()) if Path(config).is_file() else config,
                                      name=name or d.name)
    try:
        removed = claim(d, rec)
    except RunDirBusy as e:
        raise click.ClickException(str(e)) from None
    if removed is not None:
        echo_removed(removed)
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
        except ControlError as e:  # its control socket cannot be made (a run dir too long for one, ...)
            raise click.ClickException(f"cannot start: {e}") from None
        except Exception as e:
            why = _port_in_use(e)
            if why is None:
                raise
            raise click.ClickException(f"cannot start: {why}") from None
        urls = {f"udp:{p}": f"udp://{cfg.node.listen.host}:{p}" for p in node.ingest.ports}  # type: ignore[union-attr]
        if node.metrics is not None:
            node.metrics.update(node.view())  # ready from now on, not from the first control-loop pass
            base = node.metrics.url.rsplit("/", 1)[0]
            for path in getattr(node.metrics, "paths", ("/metrics",)):
                urls[path.strip("/").replace("/", "_")] = base + path
        update_record(d, ports=list(node.ingest.ports), urls=urls,  # type: ignore[union-attr]
                      shm=[node.pool.name.lstrip("/")])  # type: ignore[union-attr]
        log.info("node %s up (pid %d, run dir %s)", rec.name, os.getpid(), d)
        for key, url in urls.items():
            log.info("  %-8s %s", key, url)
        log.info("stop it with: gpuprims-orchestrator stop --%s", f"name {rec.name}" if d.parent == runtime_base()
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


@click.command()
@click.argument("config", type=click.Path(dir_okay=False), required=False)
@click.option("--model-repository", "model_repository", type=click.Path(file_okay=False, exists=True), default=None,
              help="Check this Triton model repository too (with CONFIG: replaces its node.model_repository).")
def validate(config: str | None, model_repository: str | None) -> None:
    """Check CONFIG (and/or --model-repository DIR) and print the apps it defines, or say precisely what is
    wrong."""
    cfg, config = _load(config, model_repository)
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
    for m in cfg.unavailable:
        click.echo(f"{m.name}: UNAVAILABLE: {m.reason}")
    click.echo(f"{config}: ok" if not cfg.unavailable else
               f"{config}: ok, {len(cfg.unavailable)} model(s) unavailable (listed above)")
