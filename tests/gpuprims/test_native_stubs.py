"""The typed stub gpuprims/_native.pyi stays in step with the compiled extension.

Regenerate it with ``python -m nanobind.stubgen -m gpuprims._native -o gpuprims/_native.pyi`` after
changing the bindings.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from gpuprims import _native

STUB = Path(__file__).resolve().parents[2] / "gpuprims" / "_native.pyi"


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse(STUB.read_text())
    top: set[str] = set()
    classes: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            top.add(node.name)
            classes[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    return top, classes


def test_stub_lists_exactly_the_extension_names() -> None:
    top, classes = _stub_names()
    public = {n for n in dir(_native) if not n.startswith("_")}
    assert top == public, f"stub is stale: missing {sorted(public - top)}, extra {sorted(top - public)}"
    for cls, members in classes.items():
        real = {n for n in vars(getattr(_native, cls)) if not n.startswith("_")}
        listed = {n for n in members if not n.startswith("_")}  # dunders (__init__, __len__) aside
        assert listed == real, f"{cls}: stub {sorted(members)} vs {sorted(real)}"


def test_importing_gpuprims_loads_neither_torch_nor_the_extension() -> None:
    code = ("import sys, gpuprims; assert 'torch' not in sys.modules, 'torch'; "
            "assert 'gpuprims._native' not in sys.modules, 'native'; "
            "from gpuprims import sync_lite, gpu_dma, export_parameters, multi_model, batch_latency, knee; "
            "assert callable(sync_lite) and callable(multi_model)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
