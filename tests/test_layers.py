"""The house's layers import one way, with no circle: ``bench`` -> ``orchestrator`` -> ``gpuprims`` -> ``apps``.

Every import statement counts, at module top or inside a function: a function-local import still
makes the importing module depend on the imported one, and hiding a circle inside a function is
exactly what this test exists to catch.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("apps", "gpuprims", "orchestrator")
#: Which project packages each layer may import (besides itself).
ALLOWED = {"apps": set(), "gpuprims": {"apps"}, "orchestrator": {"gpuprims", "apps"}}
#: What apps/ may import from outside the standard library.
APPS_THIRD_PARTY = {"torch", "numpy"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import name refers to (the longest known prefix), or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in MODULES:
            return cand
    return None


@functools.cache
def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported name, line) for every import in the module, relative imports made absolute (parsed once
    per run; callers do not change the list)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, node.lineno))
            # `from pkg import mod` imports the submodule pkg.mod when it is one.
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names
                    if f"{base}.{alias.name}" in MODULES]
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for name, _ in _imports(module, path):
            target = _resolve(name)
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def test_no_upward_arrow() -> None:
    bad = []
    for module, path in MODULES.items():
        layer = module.split(".")[0]
        for name, line in _imports(module, path):
            top = name.split(".")[0]
            if top in PACKAGES and top != layer and top not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {name}")
            if top == "bench":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports the benchmarks ({name})")
    assert not bad, "imports against the layering bench -> orchestrator -> gpuprims -> apps:\n" + "\n".join(bad)


def test_apps_is_a_leaf_of_torch_and_numpy() -> None:
    import sys

    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = []
    for module, path in MODULES.items():
        if not module.startswith("apps"):
            continue
        for name, line in _imports(module, path):
            top = name.split(".")[0]
            if not name or top == "apps" or top in stdlib or top in APPS_THIRD_PARTY:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "apps/ may import only torch, numpy and the standard library:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circle() -> None:
    graph = _graph()
    # A package's __init__ re-exporting its submodules is not a circle of design: the submodules
    # importing each other through it would be, so package nodes are kept but their re-export
    # arrows (package -> own submodule) are dropped.
    for module in graph:
        graph[module] = {t for t in graph[module] if not t.startswith(module + ".")}
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


#: The rooms of ``orchestrator/`` and which other rooms each may import. ``control`` is the shared
#: vocabulary and the wire (it imports no room); the worker never imports the node; the front door
#: reads the node's statistics record and repository through control's types, so the node may start it.
ROOMS: dict[str, set[str]] = {
    "control": set(),
    "config": {"control"},
    "worker": {"control"},
    "frontdoor": {"control", "config"},
    "node": {"control", "config", "worker", "frontdoor"},
    "fleet": {"control", "config", "worker", "frontdoor", "node"},
    "cli": {"control", "config", "node"},
}
#: Modules that import less than their room may: the commands that only talk to a running node.
NARROWER = {"orchestrator.cli.control": {"control"}}


def test_every_orchestrator_module_sits_in_a_room() -> None:
    loose = [m for m in MODULES if m.startswith("orchestrator.") and m.split(".")[1] not in ROOMS]
    assert not loose, f"modules outside orchestrator's rooms {sorted(ROOMS)}: {loose}"


def test_rooms_import_only_what_their_row_allows() -> None:
    bad = []
    for module, path in MODULES.items():
        if not module.startswith("orchestrator.") or module.split(".")[1] not in ROOMS:
            continue
        room = module.split(".")[1]
        allowed = NARROWER.get(module, ROOMS[room])
        for name, line in _imports(module, path):
            target = _resolve(name)
            if target is None or not target.startswith("orchestrator.") or target == "orchestrator":
                continue
            other = target.split(".")[1]
            if other != room and other not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({room}) imports {target} ({other})")
    assert not bad, "imports against the rooms table:\n" + "\n".join(bad)


def test_the_rooms_table_itself_has_no_circle() -> None:
    assert _cycles({room: set(allowed) for room, allowed in ROOMS.items()}) == []


@pytest.mark.parametrize("module", ["orchestrator.node.reconfig"])
def test_reconfig_imports_no_node_module(module: str) -> None:
    path = MODULES[module]
    names = [name for name, _ in _imports(module, path)]
    assert not [n for n in names if n.startswith("orchestrator.node.node")], names


def test_the_checker_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


#: Modules of the node process and the CLI: none may import torch (the instances run the models). Nor
#: may the instance code, its launchers and a model file's engines on ONNX Runtime and OpenVINO: an
#: instance serving such a file (and its fork server) maps no torch (issue 46).
TORCH_FREE = ("orchestrator.node.node", "orchestrator.cli.main", "orchestrator.cli.control", "orchestrator.cli.node",
              "orchestrator.config.schema", "orchestrator.node.supervisor",
              "orchestrator.frontdoor", "orchestrator.node.metrics", "orchestrator.control.status_format", "apps.zoo",
              "apps.zoo.names", "orchestrator.worker.instance", "orchestrator.worker.loops", "orchestrator.config.host",
              "orchestrator.worker.file_runner", "orchestrator.worker.launch", "orchestrator.node.launcher", "orchestrator.worker.forkserver",
              "gpuprims.engines.kinds", "gpuprims.engines.file_onnx", "gpuprims.engines.file_tensorrt")


def test_the_node_and_the_cli_never_import_torch() -> None:
    code = ("import importlib, sys\n"
            f"for m in {TORCH_FREE!r}:\n"
            "    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, f'importing {m} imported torch'\n"
            "from apps.zoo import NAMES, canonical_name, known_names\n"
            "assert canonical_name('MobileNet') == 'mobilenet_v2' and 'resnet50' in known_names()\n"
            "assert NAMES['recog_router'].num_classes == 3 and 'torch' not in sys.modules\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_the_zoo_names_agree_with_the_registry() -> None:
    from apps.zoo.names import NAMES
    from apps.zoo.registry import MODELS

    assert set(MODELS) == set(NAMES)
    for name, n in NAMES.items():
        m = MODELS[name]
        assert (m.num_classes, m.labels, m.input_shape, m.description) == (
            n.num_classes, n.labels, n.input_shape, n.description)


#: The floors of ``gpuprims/`` and which others each may import: a subpackage is one unit, and so is
#: each top-level module (``gpuprims`` itself, whose names load lazily, is not counted). The CUDA layer
#: resolves no device (``backend`` does, above it); ``coexec`` plans from task graphs and never reads
#: profiles (``profile`` builds graphs from them, ``sched`` runs the papers' scenarios over both); the
#: test rig (``testing``) sits above ``cuda`` and no library unit imports it.
GPUPRIMS_UNITS: dict[str, set[str]] = {
    "_version": set(), "wire": set(), "tensors": set(), "stats": set(), "interrupt": set(), "cpushare": set(),
    "device": set(), "batching": set(),
    "tensorwire": {"tensors"},
    "pool": {"wire"},
    "ingest": {"pool", "wire"},
    "client": {"tensorwire", "wire"},
    "cuda": {"wire"},
    "backend": {"cuda"},
    "gather": {"backend", "cuda", "stats"},
    "testing": {"cuda", "wire"},
    "coexec": set(),
    "opara": {"coexec"},
    "modelrepo": {"tensors"},
    "engines": {"_version", "backend", "coexec", "cuda", "gather", "opara", "tensors"},
    "profile": {"_version", "backend", "coexec", "cpushare", "engines", "interrupt"},
    "sched": {"coexec", "profile"},
    "traffic": {"interrupt", "tensorwire", "wire"},
}


def _gpuprims_unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "gpuprims" and len(parts) > 1 else None


def test_every_gpuprims_module_sits_in_a_unit() -> None:
    loose = sorted({u for m in MODULES if (u := _gpuprims_unit(m)) is not None and u not in GPUPRIMS_UNITS})
    assert not loose, f"gpuprims units missing from GPUPRIMS_UNITS: {loose}"


def test_gpuprims_units_import_only_what_their_row_allows() -> None:
    bad = []
    for module, path in MODULES.items():
        unit = _gpuprims_unit(module)
        if unit is None:
            continue
        for name, line in _imports(module, path):
            target = _resolve(name)
            other = _gpuprims_unit(target) if target is not None else None
            if other is not None and other != unit and other not in GPUPRIMS_UNITS[unit]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({unit}) imports {target} ({other})")
    assert not bad, "imports against the gpuprims units table:\n" + "\n".join(bad)


def test_the_gpuprims_units_table_has_no_circle() -> None:
    assert _cycles({unit: set(allowed) for unit, allowed in GPUPRIMS_UNITS.items()}) == []
