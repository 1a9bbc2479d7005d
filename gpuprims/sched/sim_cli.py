"""``gpuprims-sim``: simulate apps on GPUs with a scheduler, from profiles; every figure is simulated.

A workload comes from ``--scenario`` (``paper-table3``, ``many``) or ``--config FILE.yaml``::

    num_gpus: 1
    round_ms: 30
    profiles: [paper]            # "paper" = the bundled paper-derived profiles; or files/directories
    apps:
      - name: recog
        deadline_ms: 30
        stages:
          - {name: router, model: recog_router, gpu_pct: 25, routes: {person: face, vehicle: car}}
          - {name: face, model: vgg_face, gpu_pct: 40}
          - {name: car, model: resnet_car, gpu_pct: 50}
        route_probs: {router: {person: 0.5, vehicle: 0.4}}
        arrival: {kind: poisson, rate_rps: 200}
      - name: yolo
        deadline_ms: 30
        stages: [{name: yolo, model: yolov3, gpu_pct: 60}]
        arrival: {kind: constant, rate_rps: 66.7, burst: 2}

The output is JSON with ``"simulated": true`` at every level.

``--scenario paper-sir|paper-duet|paper-chrion`` runs the CPU co-execution comparisons instead
(``gpuprims.sched.coexec_scenarios``: accelerator profiles from the papers' tables, CPU profiles measured
on this machine); of the other options only ``--seed`` (paper-sir) and ``--out`` apply.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import click
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuprims import __version__
from gpuprims.profile.format import Profile, ProfileError, load_profiles, paper_profiles
from gpuprims.sched.coexec_scenarios import SCENARIOS as COEXEC_SCENARIOS
from gpuprims.sched.coexec_scenarios import paper_sir
from gpuprims.sched.dag import App, Stage
from gpuprims.sched.scenarios import many_apps, paper_table3
from gpuprims.sched.scheduler import SCHEDULERS, make_scheduler
from gpuprims.sched.sim import Arrival, Workload, simulate, simulate_sharded


class _StageCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    model: str
    gpu_pct: int = Field(ge=1, le=100)
    routes: dict[str, str] = Field(default_factory=dict)
    deadline_ms: float | None = Field(default=None, gt=0)


class _ArrivalCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["poisson", "constant"]
    rate_rps: float = Field(gt=0)
    burst: int = Field(default=1, ge=1)
    offset_ms: float = Field(default=0.0, ge=0)


class _AppCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    deadline_ms: float = Field(gt=0)
    gpu: int | None = Field(default=None, ge=0)
    stages: list[_StageCfg] = Field(min_length=1)
    arrival: _ArrivalCfg
    route_probs: dict[str, dict[str, float]] = Field(default_factory=dict)


class _SimCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_gpus: int = Field(default=1, ge=1)
    round_ms: float = Field(default=30.0, gt=0)
    profiles: list[str] = Field(default_factory=lambda: ["paper"])
    apps: list[_AppCfg] = Field(min_length=1)


def load_config(path: str | Path) -> tuple[list[Workload], dict[str, Profile], int, float]:
    """Parse a simulation YAML into (workloads, profiles, num_gpus, round_ms).

    Raises ValueError naming the file and the key for every problem (YAML, schema, DAG, profiles).
    """
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ValueError(f"{p}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    try:
        cfg = _SimCfg.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{p}: {problems}") from None
    profiles: dict[str, Profile] = {}
    for src in cfg.profiles:
        try:
            more = paper_profiles() if src == "paper" else load_profiles([p.parent / src])
        except ProfileError as e:
            raise ValueError(f"{p}: profiles: {e}") from None
        profiles.update(more)
    workloads = []
    for i, a in enumerate(cfg.apps):
        try:
            app = App(a.name, tuple(Stage(s.name, s.model, s.gpu_pct, s.routes, s.deadline_ms) for s in a.stages),
                      a.deadline_ms, a.gpu)
            arr = Arrival(a.arrival.kind, a.arrival.rate_rps, a.arrival.burst, a.arrival.offset_ms)
            workloads.append(Workload(app, arr, a.route_probs))
        except ValueError as e:
            raise ValueError(f"{p}: apps.{i} ({a.name}): {e}") from None
    return workloads, profiles, cfg.num_gpus, cfg.round_ms


def run(workloads: list[Workload], profiles: dict[str, Profile], *, schedulers: list[str], num_gpus: int,
        round_ms: float, duration_ms: float, warmup_ms: float, seed: int, jitter: float,
        processes: int = 1) -> dict[str, Any]:
    """Simulate the workloads under each scheduler; returns {"simulated": True, "runs": {name: result}}.

    ``processes`` > 1 splits the GPUs over that many processes (``simulate_sharded``).
    """
    apps = [w.app for w in workloads]
    out: dict[str, Any] = {"simulated": True, "runs": {}}
    for name in schedulers:
        if processes > 1:
            out["runs"][name] = simulate_sharded(name, workloads, profiles, num_gpus=num_gpus, processes=processes,
                                                 scheduler_kw={"round_ms": round_ms}, duration_ms=duration_ms,
                                                 warmup_ms=warmup_ms, seed=seed, jitter_sigma=jitter)
            continue
        sch = make_scheduler(name, apps, profiles, num_gpus=num_gpus, round_ms=round_ms)
        out["runs"][name] = simulate(sch, workloads, duration_ms=duration_ms, warmup_ms=warmup_ms, seed=seed,
                                     jitter_sigma=jitter)
    if len(schedulers) == 2 and set(schedulers) == set(SCHEDULERS):
        st, tp = out["runs"]["spatiotemporal"]["total"], out["runs"]["temporal"]["total"]
        out["throughput_ratio"] = st["throughput_rps"] / tp["throughput_rps"] if tp["throughput_rps"] else None
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="gpuprims-sim")
@click.option("--scenario", type=click.Choice(["paper-table3", "many", *COEXEC_SCENARIOS]), default=None,
              help="A built-in workload (default paper-table3 unless --config); paper-sir, paper-duet and "
                   "paper-chrion are the CPU co-execution comparisons.")
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A simulation YAML (see the module docstring).")
@click.option("--scheduler", type=click.Choice([*sorted(SCHEDULERS), "both"]), default="both", show_default=True)
@click.option("--duration-s", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True)
@click.option("--warmup-s", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--load", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="paper-table3: rate multiplier (1.0 = the rates of Table III).")
@click.option("--arrival", type=click.Choice(["constant", "poisson"]), default="constant", show_default=True,
              help="paper-table3: bursts in step with the rounds, or Poisson.")
@click.option("--gpus", type=click.IntRange(min=1), default=None, help="many: GPUs (default 8).")
@click.option("--apps", "num_apps", type=click.IntRange(min=1), default=32, show_default=True, help="many: apps.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=50.0, show_default=True,
              help="many: requests/s per app.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--jitter", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Log-normal sigma of simulated execution times.")
@click.option("--processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split the GPUs over this many processes (learned corrections then stay per process).")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None, help="Write the JSON here too.")
def main(scenario: str | None, config: str | None, scheduler: str, duration_s: float, warmup_s: float,
         load: float, arrival: str, gpus: int | None, num_apps: int, rate: float, seed: int, jitter: float,
         processes: int, out: str | None) -> None:
    """Simulate a workload under the spatio-temporal and/or temporal scheduler (results are simulated)."""
    if scenario and config:
        raise click.UsageError("give --scenario or --config, not both")
    if warmup_s >= duration_s:
        raise click.BadParameter(f"--warmup-s {warmup_s} must be less than --duration-s {duration_s}")
    round_ms = 30.0
    try:
        if scenario in COEXEC_SCENARIOS:
            res = paper_sir(seed=seed) if scenario == "paper-sir" else COEXEC_SCENARIOS[scenario]()
        else:
            if config:
                workloads, profiles, num_gpus, round_ms = load_config(config)
                if gpus is not None:
                    num_gpus = gpus
            elif scenario == "many":
                num_gpus = gpus or 8
                workloads, profiles = many_apps(num_gpus=num_gpus, num_apps=num_apps, rate_rps=rate), paper_profiles()
            else:
                num_gpus = gpus or 1
                workloads, profiles = paper_table3(load=load, kind=arrival), paper_profiles()
            names = sorted(SCHEDULERS) if scheduler == "both" else [scheduler]
            res = run(workloads, profiles, schedulers=names, num_gpus=num_gpus, round_ms=round_ms,
                      duration_ms=duration_s * 1000, warmup_ms=warmup_s * 1000, seed=seed, jitter=jitter,
                      processes=processes)
    except ValueError as e:
        click.echo(f"gpuprims-sim: {e}", err=True)
        sys.exit(2)
    text = json.dumps(res, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    click.echo(text)
    click.echo(summary(res), err=True)


def summary(res: dict[str, Any]) -> str:
    """A few rounded lines for a person (stderr), beside the JSON (stdout) that programs read."""
    if "runs" not in res:  # a CPU co-execution scenario: its own figures, ours beside the paper's
        flat = [f"{k} {v:.3g}" for k, v in (res.get("summary") or {}).items() if isinstance(v, int | float)]
        return "\n".join([f"SIMULATED (not measured): {res.get('scenario')}", *flat[:12]])
    lines = []
    for name, r in res["runs"].items():
        t = r["total"]
        util = r.get("gpu_util") or []
        lines.append(f"{name:<15} {t['throughput_rps']:>9.1f} {100 * t['miss_rate']:>7.1f} "
                     f"{_ms(t.get('latency_p50_ms')):>7} {_ms(t.get('latency_p99_ms')):>7} "
                     f"{(100 * sum(util) / len(util)) if util else 0:>6.0f}%")
    first = next(iter(res["runs"].values()))
    head = (f"SIMULATED (not measured): {first['duration_ms'] / 1000:g} s, {first['num_gpus']} GPU(s)\n"
            f"{'scheduler':<15} {'req/s':>9} {'miss %':>7} {'p50 ms':>7} {'p99 ms':>7} {'GPU':>7}")
    ratio = res.get("throughput_ratio")
    tail = [f"throughput spatio-temporal / temporal: {ratio:.2f}x"] if ratio is not None else []
    return "\n".join([head, *lines, *tail])


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    main()
