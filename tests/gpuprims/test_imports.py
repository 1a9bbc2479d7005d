"""Imports in ``gpuprims/`` sit at the top of each module, so a reader sees a module's dependencies from
its head (house style 14). An import inside a function is allowed for an optional library only, or
for torch (and once numpy) where the module must stay free of it at import, each such place named in
`LAZY` with its reason (issue 44: at most 10).

Why the torch exceptions exist: the node, the CLI and an instance serving an ONNX file on ONNX
Runtime or OpenVINO map no torch (tests/test_layers.py::test_the_node_and_the_cli_never_import_torch,
tests/orchestrator/node/test_node_imports.py), yet they import the backend resolution, the gather
path, the CUDA layer and the engine cache. The engine modules themselves import torch at their head:
config validates ``engine:`` against the torch-free table ``gpuprims.engines.kinds`` instead of
importing them.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What any gpuprims function may import: the optional extras of pyproject.toml (engines, plots,
#: images, the fleet) and the private extension, which a source tree without a build lacks (the
#: pure-Python layers and ``gpuprims.backend.native_available`` then still work).
OPTIONAL = frozenset({"onnx", "onnxruntime", "openvino", "tensorrt", "matplotlib", "skimage", "ray",
                      "gpuprims._native"})

#: (module, function, what it imports) -> why the module must stay free of it at import: torch (and the
#: zoo's models, which import it) where a torch-free process imports the module, and one numpy import.
LAZY: dict[tuple[str, str, str], str] = {
    ("gpuprims.backend", "cuda_available", "torch"): "the node resolves backends (a child does when isolated)",
    ("gpuprims.backend", "torch_device", "torch"): "as cuda_available, in the module the node imports",
    ("gpuprims.gather", "_torch", "torch"): "the instance code imports the gather path for an ONNX file too",
    ("gpuprims.cuda.dma", "_torch", "torch"): "imported by the gather path (above)",
    ("gpuprims.cuda.sync", "_torch", "torch"): "imported by the gather path (above)",
    ("gpuprims.cuda.ipc", "_torch", "torch"): "Param-Share's module is imported by an ONNX file's instance",
    ("gpuprims.engines.cache", "_torch", "torch"): "the torch-free file engines keep their artefacts there",
    ("gpuprims.engines.base", "ModelSource.build_module", "apps.zoo"): "apps.zoo.load_model builds a zoo "
        "model (torch): base is imported by the torch-free file engines",
    ("gpuprims.modelrepo.complete", "torch_export_signature", "torch"): "torch, where present: the node "
        "completes a repository's configs and never calls this",
    ("gpuprims.engines.cache", "device_identity", "gpuprims.cuda"): "the CUDA layer imports numpy, and "
        "validating ``engine:`` imports the engines package (the interface and this cache) without numpy "
        "(tests/gpuprims/engines/test_kinds.py)",
}
MAX_LAZY = 10


@dataclass(frozen=True)
class LocalImport:
    module: str
    function: str  # qualified within the module: Class.method, outer.inner
    name: str  # the imported module, absolute
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def local_imports(path: Path, module: str | None = None) -> list[LocalImport]:
    """Every import statement inside a function of `path` (module `module`, by default its name under
    the repository), with the function that holds it."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[LocalImport] = []

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, [*scope, child.name], True)
            elif isinstance(child, ast.ClassDef):
                visit(child, [*scope, child.name], in_function)
            elif isinstance(child, ast.Import | ast.ImportFrom) and in_function:
                fn = ".".join(scope)
                if isinstance(child, ast.Import):
                    out.extend(LocalImport(module, fn, a.name, child.lineno) for a in child.names)
                else:
                    base = child.module or ""
                    if child.level:
                        anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                        base = ".".join([*anchor, base] if base else anchor)
                    if base == "gpuprims" and any(a.name == "_native" for a in child.names):
                        base = "gpuprims._native"
                    out.append(LocalImport(module, fn, base, child.lineno))
            else:
                visit(child, scope, in_function)

    visit(ast.parse(path.read_text(), filename=str(path)), [], False)
    return out


@functools.cache
def _all_local_imports() -> tuple[LocalImport, ...]:
    """Every function-local import in gpuprims/ (parsed once per session)."""
    return tuple(imp for path in sorted((ROOT / "gpuprims").rglob("*.py")) for imp in local_imports(path))


def _optional(name: str) -> bool:
    return name in OPTIONAL or name.split(".")[0] in OPTIONAL


def _lazy(imp: LocalImport) -> bool:
    return (imp.module, imp.function, imp.name) in LAZY


@pytest.mark.slow
def test_function_local_imports_are_optional_libraries_or_listed() -> None:
    bad = [f"gpuprims/{imp.module.removeprefix('gpuprims.').replace('.', '/')}.py:{imp.line} "
           f"{imp.function}() imports {imp.name}"
           for imp in _all_local_imports() if not _optional(imp.name) and not _lazy(imp)]
    assert not bad, ("imports inside functions that belong at the module's head (only optional libraries, "
                     "and torch where LAZY says why, may be imported late):\n" + "\n".join(bad))


def test_lazy_imports_stay_within_their_budget_and_have_no_stale_entry() -> None:
    assert len(LAZY) <= MAX_LAZY
    used = {(imp.module, imp.function, imp.name) for imp in _all_local_imports() if _lazy(imp)}
    assert set(LAZY) == used, f"LAZY entries with no such import: {sorted(set(LAZY) - used)}"
    torch_sites = [imp for imp in _all_local_imports() if imp.name.split(".")[0] == "torch"]
    assert len(torch_sites) <= MAX_LAZY, torch_sites


@pytest.mark.parametrize(("source", "expected"), [
    ("import os\ndef f():\n    import torch\n", [("f", "torch")]),
    ("class C:\n    def m(self):\n        from gpuprims import _native\n", [("C.m", "gpuprims._native")]),
    ("def f():\n    def g():\n        from .wire import DType\n", [("f.g", "gpuprims.wire")]),
    ("import torch\nclass C:\n    import numpy\n", []),
])
def test_the_checker_finds_imports_inside_functions(tmp_path: Path, source: str,
                                                    expected: list[tuple[str, str]]) -> None:
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert [(imp.function, imp.name) for imp in local_imports(path, "gpuprims.probe")] == expected
