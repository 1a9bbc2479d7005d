"""``gpuprims-profile``: measure a model's latency/memory over batch sizes x GPU% into a profile file."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from gpuprims import __version__
from gpuprims.interrupt import ctrl_c_interrupts
from gpuprims.profile.format import save_profile
from gpuprims.profile.measure import ProfileInterrupted, measure_profile, parse_int_list, plot_profile


def _ints(label: str, lo: int = 1, hi: int | None = None, ordered: bool = False):  # type: ignore[no-untyped-def]
    def convert(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
        try:
            return parse_int_list(value, label=label, lo=lo, hi=hi, ordered=ordered)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return convert


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="gpuprims-profile")
@click.argument("model")
@click.option("--batch", "batch", default="1,2,4,8", show_default=True, callback=_ints("--batch"),
              help="Comma-separated batch sizes.")
@click.option("--gpu-pct", "gpu_pct", default="25,50,75,100", show_default=True,
              callback=_ints("--gpu-pct", 1, 100), help="Comma-separated GPU% (CPU backend: share of cores).")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="Profile JSON to write.")
@click.option("--backend", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--input-shape", default="3,224,224", show_default=True, callback=_ints("--input-shape", ordered=True),
              help="One sample's shape, comma-separated.")
@click.option("--repeats", type=click.IntRange(min=2), default=20, show_default=True,
              help="Timed forward passes per point.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True)
@click.option("--width", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Channel width multiplier of zoo models (small test variants).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Seconds allowed per point.")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="Also draw latency vs GPU% per batch size, knee marked (PNG).")
@click.option("--device", "device_kind", type=click.Choice(["accelerator", "cpu"]), default=None,
              help="Which device of a co-executing node this profile describes (format v2): 'cpu' measures the "
                   "CPU overflow pool (CPU backend, --gpu-pct as a share of --cores).")
@click.option("--cores", type=click.IntRange(min=1), default=None,
              help="--device cpu: size of the CPU pool in cores (default: every core this process may use).")
@click.option("--stages", is_flag=True, help="Also time each DUET subgraph (torch.fx branches) alone on the device.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--engine", default="eager", show_default=True,
              help="The engine (apps.yaml engine:) to measure, so Multi-Model sizes an app from what it runs.")
@click.option("--engine-option", "engine_option", multiple=True, metavar="KEY=VALUE",
              help="An option of --engine (repeatable), e.g. provider=cpu.")
@click.option("--engine-cache", default=None, type=click.Path(file_okay=False),
              help="The engine cache (default: the per-user one, as node.engine_cache).")
def main(model: str, batch: list[int], gpu_pct: list[int], out: str, backend: str, input_shape: list[int],
         repeats: int, warmup: int, width: float, timeout_s: float, plot: str | None, device_kind: str | None,
         cores: int | None, stages: bool, no_progress: bool, engine: str, engine_option: tuple[str, ...],
         engine_cache: str | None) -> None:
    """Measure MODEL (a zoo name or module:factory) at every --batch x --gpu-pct point.

    Each point runs in a fresh process with its share applied before torch initialises (MPS thread
    percentage on CUDA, a share of cores on CPU).
    """
    if cores is not None and device_kind != "cpu":
        raise click.UsageError("--cores applies to --device cpu only")
    options: dict[str, str] = {}
    for item in engine_option:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise click.UsageError(f"--engine-option takes KEY=VALUE, got {item!r}")
        options[key] = value
    try:
        pool = None
        if cores is not None:
            avail = sorted(os.sched_getaffinity(0))
            if cores > len(avail):
                raise ValueError(f"--cores {cores}: only {len(avail)} cores are available to this process")
            pool = avail[:cores]
        with ctrl_c_interrupts():  # the points measured so far are kept, however this was started
            prof = measure_profile(model, batch_sizes=batch, gpu_pcts=gpu_pct, backend=backend,
                                   input_shape=input_shape, repeats=repeats, warmup=warmup, width=width,
                                   timeout_s=timeout_s, progress=not no_progress, device_kind=device_kind,
                                   cores=pool, stages=stages, engine=engine, engine_options=options,
                                   engine_cache=engine_cache)
    except (ValueError, RuntimeError) as e:
        click.echo(f"gpuprims-profile: {e}", err=True)
        sys.exit(2)
    except ProfileInterrupted as e:
        _save_interrupted(e, out)
        sys.exit(130)
    path = save_profile(prof, out)
    extra = f" and {len(prof.stages)} stages" if prof.stages else ""
    click.echo(f"backend {prof.backend} ({prof.device}, {prof.kind}); wrote {len(prof.points)} points{extra} to {path}")
    if plot:
        click.echo(f"plot: {plot_profile(prof, plot)}")


def _save_interrupted(e: ProfileInterrupted, out: str) -> None:
    """Ctrl-C: every measured point goes to OUT.partial.json; the batch sizes measured at every GPU%
    also make a valid profile at OUT."""
    raw = Path(out).with_suffix(".partial.json")
    raw.write_text(json.dumps({"measured": len(e.points), "of": e.total, "points": e.points}, indent=1) + "\n")
    msg = f"gpuprims-profile: interrupted after {len(e.points)} of {e.total} points; measured points in {raw}"
    if e.partial is not None:
        path = save_profile(e.partial, out)
        msg += f"; batch sizes {e.partial.batch_sizes} (complete) in {path}"
    click.echo(msg, err=True)


if __name__ == "__main__":
    main()
