"""``gpuprims-engine``: build every app's engine ahead of time, so a node's first start is not a silent wait.

``gpuprims-engine build apps.yaml`` makes, for every app of the file (every stage of a DAG app, and the
CPU overflow instance's engine where the app overflows), the engine the node would make, and prepares it
into the engine cache (``node.engine_cache``, or ``--cache-dir``): built now, or found there already.
A progress bar goes over the engines; a build says how far it is as it goes. An engine that cannot take
its model is reported in one line naming the app, the engine and the reason, the others are still
built, and the command exits 1. ``eager`` has nothing to build and is listed as such.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import click
from tqdm import tqdm

from apps.zoo.names import known_names
from gpuprims.backend import resolve_backend
from gpuprims.engines import EngineCache, EngineError, ModelSource, Target, make_engine
from orchestrator.config.schema import (
    AppConfig,
    ConfigError,
    EngineChoice,
    NodeConfig,
    engine_problems,
    load_config,
)

log = logging.getLogger("gpuprims.engines")


@dataclass(frozen=True)
class Job:
    """One engine to build: which app (and stage, or the overflow instance), on which backend."""

    app: str
    where: str  # "", "stage NAME" or "overflow"
    model: str
    engine: EngineChoice
    backend: str
    source: ModelSource

    @property
    def label(self) -> str:
        return f"{self.app}{f' ({self.where})' if self.where else ''}: {self.engine.kind}"


def jobs_of(cfg: NodeConfig, backend: str) -> list[Job]:
    """Every engine the node would make for ``cfg`` on ``backend``, in file order."""
    out: list[Job] = []

    def add(app: AppConfig, where: str, model: str, engine: EngineChoice, on: str) -> None:
        source = ModelSource(model, tuple(app.input_shape), app.max_batch, seed=app.seed,
                             num_classes=None if app.stages else app.num_classes)
        out.append(Job(app.name, where, model, engine, on, source))

    for app in cfg.apps:
        if app.stages is None:
            assert app.model is not None
            add(app, "", app.model, app.engine, backend)
        else:
            for st in app.stages:
                add(app, f"stage {st.name}", st.model, app.stage_engine(st), backend)
        if app.overflow == "cpu" and app.model is not None:
            add(app, "overflow", app.model, app.cpu_overflow_engine, "cpu")
    return out


def build_one(job: Job, cache: EngineCache, gpu: int, bar: Any = None) -> dict[str, Any]:
    """Prepare one engine into ``cache``; returns what it did (``describe()``). Raises EngineError."""
    def progress(msg: str, fraction: float | None) -> None:
        text = f"{job.label}: {msg}" + ("" if fraction is None else f" ({fraction:.0%})")
        log.info("%s", text)
        if bar is not None:
            bar.set_postfix_str(text[:80])

    engine = make_engine(job.engine.kind, job.source, Target(job.backend, gpu if job.backend == "cuda" else 0),
                         job.engine.options, cache=cache)
    try:
        engine.prepare(None, progress)
        return engine.describe()
    finally:
        engine.close()


@click.group()
def main() -> None:
    """Build and inspect the engines (``engine:`` in apps.yaml) of a node's apps."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--cache-dir", default=None, help="The engine cache to fill (default: node.engine_cache, else "
              "the per-user default).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per engine instead of a line.")
@click.option("--no-progress", is_flag=True, help="No progress bar (logs only).")
def build(config: str, cache_dir: str | None, as_json: bool, no_progress: bool) -> None:
    """Build every app's engine in CONFIG into the engine cache (a cache hit builds nothing)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        cfg = load_config(config, known_models=known_names())
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    try:
        backend = resolve_backend(cfg.node.backend)
    except (RuntimeError, ValueError) as e:
        raise click.ClickException(f"{config}: node.backend: {e}") from e
    problems = engine_problems(cfg, backend)
    if problems:
        raise click.ClickException(str(ConfigError(config, problems)))
    cache = EngineCache(cache_dir or cfg.node.engine_cache)
    jobs = jobs_of(cfg, backend)
    failed = 0
    with tqdm(total=len(jobs), unit="engine", disable=no_progress or None, leave=False) as bar:
        for job in jobs:
            bar.set_description(job.label)
            if job.engine.kind == "eager":
                result: dict[str, Any] = {"kind": "eager", "built": False, "note": "nothing to build"}
            else:
                try:
                    result = build_one(job, cache, cfg.gpu_of(cfg.app_by_name(job.app)), bar)
                except EngineError as e:
                    failed += 1
                    result = {"kind": job.engine.kind, "error": str(e)}
            bar.update(1)
            line = {"app": job.app, "where": job.where or None, "model": job.model, "backend": job.backend, **result}
            if as_json:
                tqdm.write(json.dumps(line, default=str))
            elif "error" in line:
                tqdm.write(f"{job.label}: FAILED: {line['error']}")
            elif job.engine.kind == "eager":
                tqdm.write(f"{job.label}: nothing to build")
            else:
                what = "cache hit" if line.get("cache_hit") else f"built in {float(line.get('build_ms') or 0) / 1e3:.1f} s"
                tqdm.write(f"{job.label}: {what} ({line.get('fingerprint')})")
    click.echo(f"{config}: {len(jobs) - failed} of {len(jobs)} engine(s) ready in {cache.root}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
