"""Ask every model of a running node three ways and check each answer against the model file run directly.

``python examples/repository_client.py [--repository build/example-repository] [--http 127.0.0.1:8000]
[--grpc 127.0.0.1:8001] [--udp 127.0.0.1:9000]``: for every model the node's repository index lists READY,
sends requests over HTTP and gRPC (tritonclient) and over UDP (``gpuprims.client`` with a dict of named
arrays), runs the same inputs through the model file in its own runtime (ONNX Runtime, ``torch.jit.load``,
``torch.export.load``) and prints one row per model and path. Exits 1 when any answer differs (or a model
is not READY), 0 when every one matches.

Inputs follow each model's config as the node reports it (``GET /v2/models/<m>/config``), so the script
takes any repository whose models have numeric tensors; the example repository's (examples/
model_repository.py) get requests that mean something: valid ids for ``mixed``, several widths for
``ocr``, images that keep none, a few or many boxes for ``detector``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from gpuprims.client import Client

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = ROOT / "build" / "example-repository"
#: Tolerance of a float answer against the file run directly: the engines' own (docs/engines.md) is
#: tighter, but the node runs a batch where the oracle runs one request, and kernels sum in another order.
RTOL = 1e-3
ATOL = 1e-4
#: FP16 answers: one half-precision step near 1.
ATOL_FP16 = 2e-3
#: Each request's deadline (the wire's ``deadline_us``, OIP's ``timeout``): this client checks answers, not
#: latency, so a request may take this long on a busy machine before the node gives up on it; without it
#: the model's ``slo_ms`` is the deadline and a loaded laptop answers some DEADLINE_MISSED.
DEADLINE_US = 10_000_000

_NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class Tensor:
    """One input or output as the model's config gives it (dims without the batch dimension)."""

    name: str
    datatype: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Model:
    """A model of the node: its config's tensors and batching, its file, and its UDP app id."""

    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    max_batch_size: int
    app_id: int
    file: Path

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0


@dataclass
class Row:
    """The answers of one model over one path: how many requests, how many matched, the largest error."""

    model: str
    path: str
    requests: int = 0
    matched: int = 0
    max_abs_err: float = 0.0
    shapes: set[str] = field(default_factory=set)
    #: The shapes of the first output answered (a detector's differ with the image).
    out_shapes: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.requests > 0 and self.matched == self.requests and not self.problems


# -- the oracle: the file run directly ----------------------------------------------------------------------

class Oracle:
    """A model file run in its own runtime (CPU): ONNX Runtime for .onnx, ``torch.jit.load`` for .pt,
    ``torch.export.load(...).module()`` for .pt2. Takes and returns batched tensors (or, for a model
    without batching, the request's tensors as they are) by the config's names."""

    def __init__(self, model: Model) -> None:
        self.model = model
        suffix = model.file.suffix.lower()
        if suffix == ".onnx":
            import onnxruntime as ort

            session = ort.InferenceSession(str(model.file), providers=["CPUExecutionProvider"])
            names = [o.name for o in model.outputs]
            self._run: Callable[[Tensors], Tensors] = lambda x: dict(zip(names, session.run(names, x)))
        elif suffix in (".pt", ".pt2"):
            import torch

            with warnings.catch_warnings():  # torch.jit.load is deprecated; a .pt file is TorchScript all the same
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(str(model.file)) if suffix == ".pt" else torch.export.load(str(model.file)).module()

            def run(x: Tensors) -> Tensors:
                # Triton's binding of a torch file: inputs in the config's order, outputs by position.
                with torch.inference_mode():
                    out = module(*[torch.from_numpy(np.ascontiguousarray(x[t.name])) for t in model.inputs])
                outs = out if isinstance(out, tuple | list) else (out,)
                return {t.name: o.numpy() for t, o in zip(model.outputs, outs)}

            self._run = run
        else:
            raise ValueError(f"{model.file}: no direct runtime for {suffix} files in this client")

    def __call__(self, x: Tensors) -> Tensors:
        return self._run(x)


# -- reading the node -----------------------------------------------------------------------------------------

def _tensors(entries: list[dict[str, Any]]) -> tuple[Tensor, ...]:
    return tuple(Tensor(e["name"], str(e["data_type"]).removeprefix("TYPE_"), tuple(int(d) for d in e.get("dims", ())))
                 for e in entries)


def model_file(repository: Path, name: str, version: str | None = None) -> Path:
    """The file a repository serves for model ``name``: ``<name>/<version>/model.*`` of the given version,
    else the highest."""
    versions = sorted(int(p.name) for p in (repository / name).iterdir() if p.is_dir() and p.name.isdigit())
    if not versions:
        raise FileNotFoundError(f"{repository / name}: no version directory")
    v = version if version else str(versions[-1])
    found = sorted((repository / name / v).glob("model.*"))
    if not found:
        raise FileNotFoundError(f"{repository / name / v}: no model.* file")
    return found[0]


def read_models(http: httpclient.InferenceServerClient, repository: Path,
                app_ids: dict[str, int]) -> tuple[list[Model], dict[str, str]]:
    """The node's READY models (from its repository index and each model's config) and the others with
    their reason. ``app_ids`` maps a model's name to its UDP app id."""
    models: list[Model] = []
    unavailable: dict[str, str] = {}
    for entry in http.get_model_repository_index():
        name = entry["name"]
        if entry.get("state") != "READY":
            unavailable[name] = entry.get("reason", entry.get("state", "?"))
            continue
        cfg = http.get_model_config(name)
        models.append(Model(name=name, inputs=_tensors(cfg.get("input", [])), outputs=_tensors(cfg.get("output", [])),
                            max_batch_size=int(cfg.get("max_batch_size", 0)), app_id=app_ids[name],
                            file=model_file(repository, name, str(entry.get("version") or "") or None)))
    return models, unavailable


# -- requests ----------------------------------------------------------------------------------------------------

def _fill(t: Tensor, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(_NUMPY[t.datatype])
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 8, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def requests_for(model: Model, seed: int = 0) -> list[Tensors]:
    """A few requests for ``model``, each its tensors without a batch dimension (a model without batching:
    its whole tensors). Dynamic dimensions take two sizes, so requests of several shapes are sent; the
    example repository's models get inputs that exercise them."""
    rng = np.random.default_rng(seed)
    if model.name == "detector" and model.inputs[0].dims == (3, 64, 64):
        # A blank image keeps no box, a faint one a few, a bright busy one many: outputs of three sizes.
        return [{"image": (rng.random((3, 64, 64), dtype=np.float32) * scale).astype(np.float32)}
                for scale in (0.0, 1.0, 3.0)]
    out = []
    for size in (5, 23):
        x = {t.name: _fill(t, tuple(size if d < 0 else d for d in t.dims), rng) for t in model.inputs}
        if model.name == "mixed" and "ids" in x:
            x["ids"] = rng.integers(0, 100, size=x["ids"].shape).astype(np.int64)  # the vocabulary's ids
        out.append(x)
    return out


def _batch(model: Model, rows: list[Tensors]) -> Tensors:
    """The rows as one request's tensors: stacked along a batch dimension for a batched model."""
    if not model.batched:
        assert len(rows) == 1
        return rows[0]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _row(model: Model, x: Tensors, i: int) -> Tensors:
    return {k: v[i] for k, v in x.items()} if model.batched else x


# -- comparing ---------------------------------------------------------------------------------------------------

def compare(got: Tensors, want: Tensors, outputs: tuple[Tensor, ...]) -> tuple[list[str], float]:
    """What differs between an answer and the oracle's (empty when they match within the tolerance),
    and the largest absolute difference of a float output."""
    problems: list[str] = []
    worst = 0.0
    for t in outputs:
        g, w = got.get(t.name), want[t.name]
        if g is None:
            problems.append(f"{t.name}: missing")
            continue
        g = np.asarray(g)
        if g.dtype != w.dtype or g.shape != w.shape:
            problems.append(f"{t.name}: {g.dtype}{list(g.shape)}, the file gives {w.dtype}{list(w.shape)}")
            continue
        if w.dtype.kind == "f":
            diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
            worst = max(worst, float(diff.max()) if diff.size else 0.0)
            atol = ATOL_FP16 if w.dtype == np.float16 else ATOL
            if not np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=RTOL, atol=atol):
                problems.append(f"{t.name}: differs by up to {float(diff.max()):.3g}")
        elif not np.array_equal(g, w):
            problems.append(f"{t.name}: {int((g != w).sum())} of {w.size} elements differ")
    return problems, worst


def _shape_text(x: Tensors) -> str:
    return ",".join(f"{list(v.shape)}" for v in x.values())


# -- the three paths ---------------------------------------------------------------------------------------------

def _http_infer(c: httpclient.InferenceServerClient, model: Model, x: Tensors) -> Tensors:
    inputs = []
    for t in model.inputs:
        arr = x[t.name]
        i = httpclient.InferInput(t.name, list(arr.shape), t.datatype)
        i.set_data_from_numpy(arr, binary_data=True)
        inputs.append(i)
    res = c.infer(model.name, inputs, timeout=DEADLINE_US)
    out: Tensors = {}
    for t in model.outputs:
        arr = res.as_numpy(t.name)
        meta = res.get_output(t.name) or {}
        shape = [int(d) for d in meta.get("shape", ())]
        if arr is not None and arr.size == 0 and math.prod(shape) == 0:
            # tritonclient's HTTP reads an empty binary output (binary_data_size 0, as Triton sends it too)
            # as float64 of shape (0,): the answer's own datatype and shape are in its header.
            arr = np.empty(shape, _NUMPY[meta["datatype"]])
        out[t.name] = arr
    return out


def _grpc_infer(c: grpcclient.InferenceServerClient, model: Model, x: Tensors) -> Tensors:
    inputs = []
    for t in model.inputs:
        arr = x[t.name]
        i = grpcclient.InferInput(t.name, list(arr.shape), t.datatype)
        i.set_data_from_numpy(arr)
        inputs.append(i)
    res = c.infer(model.name, inputs, timeout=DEADLINE_US, client_timeout=2 * DEADLINE_US / 1e6)
    return {t.name: res.as_numpy(t.name) for t in model.outputs}


def _check(row: Row, model: Model, got: Tensors, want: Tensors, shape: str) -> None:
    row.requests += 1
    row.shapes.add(shape)
    first = got.get(model.outputs[0].name)
    if first is not None:
        row.out_shapes.add(str(list(np.shape(first))))
    problems, worst = compare(got, want, model.outputs)
    row.max_abs_err = max(row.max_abs_err, worst)
    if problems:
        row.problems.append(f"request {row.requests} ({shape}): " + "; ".join(problems))
    else:
        row.matched += 1


def _guard(row: Row, step: Callable[[], None]) -> None:
    """Run one path's requests; a failure (an error answer, a timeout) is the row's problem, not the run's end."""
    try:
        step()
    except Exception as e:  # the client reports every path's failure in the table; exit code says it failed
        row.problems.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def check_model(model: Model, http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient,
                udp: Client, seed: int = 0) -> list[Row]:
    """One row per path (http, grpc, udp) of ``model``: its requests sent one at a time and, for a batched
    model, all of them at once as one batch over HTTP and gRPC, each answer compared with the file's."""
    oracle = Oracle(model)
    reqs = requests_for(model, seed)
    rows = {p: Row(model.name, p) for p in ("http", "grpc", "udp")}
    # Requests of one shape may go as one batch (a dynamic dimension must agree within a batch).
    groups: dict[str, list[Tensors]] = {}
    for r in reqs:
        groups.setdefault(_shape_text(r), []).append(r)
    singles = [_batch(model, [r]) for r in reqs]
    # ...and three copies of each, up to the model's max_batch_size, as one batch of several rows.
    batches = [_batch(model, (g * 3)[:model.max_batch_size]) for g in groups.values()] if model.batched else []

    def over(row: Row, infer: Callable[[Tensors], Tensors]) -> Callable[[], None]:
        def step() -> None:
            for x in singles + batches:
                _check(row, model, infer(x), oracle(x), _shape_text(x))
        return step

    _guard(rows["http"], over(rows["http"], lambda x: _http_infer(http, model, x)))
    _guard(rows["grpc"], over(rows["grpc"], lambda x: _grpc_infer(grpc, model, x)))

    def udp_step() -> None:
        for x in singles:
            r = udp.infer(model.app_id, _row(model, x, 0), deadline_us=DEADLINE_US).raise_for_status()
            want = oracle(x)
            _check(rows["udp"], model, dict(r.outputs or {}), {k: _row(model, want, 0)[k] for k in want},
                   _shape_text(_row(model, x, 0)))

    _guard(rows["udp"], udp_step)
    return list(rows.values())


def app_ids_from_status(status: dict[str, Any]) -> dict[str, int]:
    """Each app's UDP app id from the node's status (``gpuprims-orchestrator status --json``)."""
    apps = status.get("apps", {})
    items = apps.items() if isinstance(apps, dict) else ((a.get("name"), a) for a in apps)
    return {str(name): int(a["app_id"]) for name, a in items if isinstance(a, dict) and "app_id" in a}


def check_node(http_url: str, grpc_target: str, udp: tuple[str, int], repository: Path,
               app_ids: dict[str, int], timeout_s: float = 30.0) -> tuple[list[Row], dict[str, str]]:
    """Every READY model of the node checked over HTTP, gRPC and UDP (:func:`check_model`), and the
    models that are not READY with their reason."""
    http = httpclient.InferenceServerClient(http_url, network_timeout=timeout_s, connection_timeout=timeout_s)
    grpc = grpcclient.InferenceServerClient(grpc_target)
    try:
        models, unavailable = read_models(http, repository, app_ids)
        rows: list[Row] = []
        with Client(udp, timeout_s=timeout_s) as c:
            for i, m in enumerate(models):
                rows += check_model(m, http, grpc, c, seed=i)
        return rows, unavailable
    finally:
        http.close()
        grpc.close()


def format_table(rows: list[Row], unavailable: dict[str, str]) -> str:
    """The rows as a table (one line per model and path, then each failure and each unavailable model)."""
    lines = [f"{'model':<10}{'path':<6}{'requests':>9}{'matched':>9}{'max |err|':>11}  {'':<9}"
             "input shapes -> first output's shapes"]
    for r in rows:
        err = f"{r.max_abs_err:.2g}" if math.isfinite(r.max_abs_err) else "-"
        shapes = " ".join(sorted(r.shapes)) + " -> " + " ".join(sorted(r.out_shapes))
        lines.append(f"{r.model:<10}{r.path:<6}{r.requests:>9}{r.matched:>9}{err:>11}  "
                     f"{'ok' if r.ok else 'MISMATCH':<9}{shapes[:90]}")
    for r in rows:
        lines += [f"  {r.model} over {r.path}: {p}" for p in r.problems]
    lines += [f"  {name}: not READY: {why}" for name, why in unavailable.items()]
    return "\n".join(lines)


def wait_ready(http_url: str, deadline_s: float) -> None:
    """Return once ``GET /v2/health/ready`` answers 200, or raise TimeoutError after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    c = httpclient.InferenceServerClient(http_url, connection_timeout=2.0, network_timeout=2.0)
    try:
        while True:
            try:
                if c.is_server_ready():
                    return
            except Exception:  # not listening yet: connection refused, reset
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"http://{http_url}/v2/health/ready did not answer 200 within {deadline_s:.0f} s")
            time.sleep(0.2)
    finally:
        c.close()


def node_status(name: str | None) -> dict[str, Any]:
    """The node's status through the control CLI (``--name`` when given, else the only node running)."""
    import json
    import subprocess

    exe = Path(sys.executable).with_name("gpuprims-orchestrator")
    cmd = [str(exe) if exe.exists() else "gpuprims-orchestrator", "status", "--json"] + (["--name", name] if name else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(out.stdout))


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def iter_failures(rows: list[Row], unavailable: dict[str, str]) -> Iterator[str]:
    """Every reason the run failed: a row that did not match, a model not READY."""
    yield from (f"{r.model} over {r.path}" for r in rows if not r.ok)
    yield from (f"{n} not READY" for n in unavailable)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repository", default=str(DEFAULT_REPOSITORY), help="the repository the node serves")
    ap.add_argument("--http", default="127.0.0.1:8000", help="the node's HTTP front door (host:port)")
    ap.add_argument("--grpc", default="127.0.0.1:8001", help="the node's gRPC front door (host:port)")
    ap.add_argument("--udp", default="127.0.0.1:9000", help="the node's UDP listen address (host:port)")
    ap.add_argument("--name", default=None, help="the node's --name (to read the app ids from its status)")
    ap.add_argument("--wait", type=float, default=0.0, help="first wait this many seconds for the node to be ready")
    args = ap.parse_args(argv)
    if args.wait:
        wait_ready(args.http, args.wait)
    app_ids = app_ids_from_status(node_status(args.name))
    rows, unavailable = check_node(args.http, args.grpc, _split(args.udp), Path(args.repository), app_ids)
    print(format_table(rows, unavailable))
    failures = list(iter_failures(rows, unavailable))
    if failures:
        print(f"FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    print(f"every answer of {len({r.model for r in rows})} models over HTTP, gRPC and UDP equals the model file run "
          "directly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
