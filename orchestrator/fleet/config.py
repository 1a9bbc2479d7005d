"""fleet.yaml: the apps a fleet serves and how its controller watches the machines.

```yaml
ray:
  address: null        # null: start a local Ray cluster (for trying it); "auto" or host:port: join one
  token_file: null     # Ray's token (RAY_AUTH_MODE=token); a local cluster without one generates it
  resource: gpuprims   # the custom resource that marks machines that run gpuprims
  head_outage_s: 86400 # how long the machines keep serving while the head is gone (>= 60)
host: 127.0.0.1        # what each node listens on (clients must reach it); "auto": the Ray node's IP
gpus_per_node: 1
ping_interval_s: 0.2   # the controller's own pings of every agent
suspect_after_s: 1.0   # no answer this long: the node is suspected, its apps' routes flip to standby
default_gpu_pct: 25    # the share of an app with gpu_pct: auto and no profile
profiles: null         # directory of gpuprims-profile files (sizing and the simulator's scores)
node: {backend: cpu}   # apps.yaml `node:` keys every node gets (listen, http_port, run_dir are the agent's)
apps:                  # apps.yaml app entries, plus `rate_rps` (expected load) and `standby` (default true)
  - {name: cls, model: mobilenet_v2, slo_ms: 50, rate_rps: 50}
```

:func:`load_fleet_config` validates each app entry exactly as apps.yaml does (one at a time: the
GPU is the planner's to choose), and raises :class:`orchestrator.config.schema.ConfigError` naming the file,
the key and what is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchestrator.config.schema import ConfigError, parse_config

#: Keys of a fleet app entry that are the fleet's, not the node's.
FLEET_APP_KEYS = ("rate_rps", "standby")
#: Node keys the agent sets itself.
AGENT_NODE_KEYS = ("listen", "http_port", "run_dir", "repository", "fleet_routes")


class RayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    address: str | None = None
    token_file: str | None = None
    resource: str = "gpuprims"
    #: How long the gpuprims machines keep serving while the head is gone: Ray's raylets and workers
    #: (the agents, and with them the nodes) give up on a lost GCS after this (Ray's default, 60 s,
    #: would stop the whole fleet a minute after the head dies).
    head_outage_s: int = Field(86400, ge=60, le=30 * 86400)

    def system_config(self) -> dict[str, int]:
        """Ray's ``_system_config`` for the head this fleet starts (docs/fleet.md: ``ray start``)."""
        return {"gcs_rpc_server_reconnect_timeout_s": self.head_outage_s}


class FleetConfig(BaseModel):
    """A validated fleet.yaml (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    ray: RayConfig = RayConfig()
    host: str = "127.0.0.1"
    gpus_per_node: int = Field(1, ge=1, le=64)
    ping_interval_s: float = Field(0.2, gt=0, le=10)
    suspect_after_s: float = Field(1.0, gt=0, le=60)
    default_gpu_pct: int = Field(25, ge=1, le=100)
    profiles: str | None = None
    node: dict[str, Any] = Field(default_factory=dict)
    apps: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("node")
    @classmethod
    def _node(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(v) & set(AGENT_NODE_KEYS))
        if taken:
            raise ValueError(f"{', '.join(taken)} are set by each machine's agent; remove them")
        return v

    def node_entry(self, app: dict[str, Any]) -> dict[str, Any]:
        """The app's apps.yaml entry as a node gets it (the fleet's own keys removed)."""
        return {k: v for k, v in app.items() if k not in FLEET_APP_KEYS}


def parse_fleet_config(data: Any, *, source: str = "<fleet>") -> FleetConfig:
    """Validate a parsed fleet.yaml (see :func:`load_fleet_config`)."""
    if not isinstance(data, dict):
        raise ConfigError(source, [("", "the top level must be a mapping with 'apps:'")])
    try:
        cfg = FleetConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, [(".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, "))
                                   for err in e.errors(include_url=False)]) from None
    problems: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, app in enumerate(cfg.apps):
        rate = app.get("rate_rps")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0):
            problems.append((f"apps[{i}].rate_rps", f"must be a positive number (requests/s), got {rate!r}"))
        if not isinstance(app.get("standby", True), bool):
            problems.append((f"apps[{i}].standby", f"must be true or false, got {app.get('standby')!r}"))
        if "gpu" in app:
            problems.append((f"apps[{i}].gpu", "the fleet's planner chooses the node and GPU; remove it"))
        try:
            one = parse_config({"node": {k: v for k, v in cfg.node.items()}, "apps": [cfg.node_entry(app)]},
                               source=source)
        except ConfigError as e:
            problems += [(k.replace("apps[0]", f"apps[{i}]", 1), w) for k, w in e.problems]
            continue
        name = one.apps[0].name
        if name in seen:
            problems.append((f"apps[{i}].name", f"duplicate name {name!r} (also apps[{seen[name]}])"))
        seen.setdefault(name, i)
    if problems:
        raise ConfigError(source, problems)
    return cfg


def load_fleet_config(path: str | os.PathLike[str]) -> FleetConfig:
    """Read and validate fleet.yaml; ConfigError names the file, the key and the problem."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(str(p), [("", e.strerror or str(e))]) from None
    except yaml.YAMLError as e:
        raise ConfigError(str(p), [("", f"YAML error: {e}")]) from None
    return parse_fleet_config(data, source=str(p))
