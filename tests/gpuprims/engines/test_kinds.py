"""gpuprims.engines.kinds: the table the node validates ``engine:`` against, without importing any
engine's module (nor torch, numpy or an engine library: the package imports only the interface and the cache); each engine class takes its rules from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuprims.engines.errors import EngineError, EngineUnavailable
from gpuprims.engines.kinds import ENGINE_KINDS, FILE_ENGINE_KINDS, EngineKind, engine_kind, file_engine_kind

ROOT = Path(__file__).resolve().parents[3]

_VALIDATE_ALL = """
import sys
from gpuprims.engines.kinds import ENGINE_KINDS, FILE_ENGINE_KINDS
for table in (ENGINE_KINDS, FILE_ENGINE_KINDS):
    for kind in table.values():
        kind.validate_options(None)
        for backend in kind.backends:
            try:
                kind.check(backend)
            except Exception as e:  # a library missing here is fine; an import is not
                assert type(e).__name__ == "EngineUnavailable", e
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "onnxruntime", "openvino", "onnx",
                "tensorrt") or m.startswith(("gpuprims.engines.", "apps.")) and m not in (
                "gpuprims.engines.kinds", "gpuprims.engines.errors", "gpuprims.engines.base", "gpuprims.engines.cache"))
print(loaded)
"""


@pytest.mark.real
def test_validating_every_kind_imports_no_engine_module() -> None:
    r = subprocess.run([sys.executable, "-c", _VALIDATE_ALL], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("table", [ENGINE_KINDS, FILE_ENGINE_KINDS], ids=["zoo", "file"])
def test_each_class_takes_its_rules_from_its_row(table: dict[str, EngineKind]) -> None:
    for name, kind in table.items():
        cls = kind.load()
        assert cls.kind == name
        assert cls.spec is kind and "validate_options" not in vars(cls) and "check" not in vars(cls), name
        assert dict(cls.option_defaults) == dict(kind.options) and tuple(cls.backends) == kind.backends, name


def test_options_and_backends_are_refused_by_name() -> None:
    with pytest.raises(EngineError, match=r"engine 'compile' has no option\(s\) \['modes'\] \(it takes: backend, "):
        engine_kind("compile").validate_options({"modes": "x"})
    with pytest.raises(EngineError, match="mode must be one of default, reduce-overhead"):
        engine_kind("compile").validate_options({"mode": "fastest"})
    with pytest.raises(EngineError, match="options must be a mapping"):
        engine_kind("eager").validate_options(["fast"])  # type: ignore[arg-type]
    with pytest.raises(EngineError, match=r"option warmup must be an integer in 1\.\.100, got True"):
        engine_kind("cudagraph").validate_options({"warmup": True})
    with pytest.raises(EngineError, match="max_streams=4 applies only to streams: opara"):
        engine_kind("cudagraph").validate_options({"max_streams": 4})
    with pytest.raises(EngineUnavailable, match="engine 'cudagraph' needs the cuda backend; this node runs on cpu"):
        engine_kind("cudagraph").check("cpu")
    with pytest.raises(EngineUnavailable, match="provider 'cuda' needs the cuda backend"):
        file_engine_kind("onnxruntime").check("cpu", {"provider": "cuda"})
    with pytest.raises(EngineError, match="unknown engine 'fast'; known engines: eager, onnxruntime"):
        engine_kind("fast")
    with pytest.raises(EngineError, match="unknown model file engine 'eager'; known: onnxruntime"):
        file_engine_kind("eager")
    assert engine_kind("auto").validate_options({"candidates": ("eager", "onnxruntime")})["candidates"] == [
        "eager", "onnxruntime"]


def test_a_missing_library_is_named_with_its_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    monkeypatch.delitem(sys.modules, "openvino", raising=False)
    with pytest.raises(EngineUnavailable, match=r"needs the openvino package: pip install 'gpuprims\[openvino\]'"):
        engine_kind("openvino").check("cpu")


def test_what_each_kind_needs_of_torch() -> None:
    """Only kinds that run the model with torch say they need it: the fork servers split on this."""
    torch_free = {n for n, k in ENGINE_KINDS.items() if not k.needs_torch}
    assert torch_free == {"onnxruntime", "openvino", "tensorrt"}
    assert {n for n, k in FILE_ENGINE_KINDS.items() if not k.needs_torch} == {"onnxruntime", "openvino", "tensorrt"}
