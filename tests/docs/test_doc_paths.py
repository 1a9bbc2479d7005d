"""Every file, module and link the docs name exists, so the map cannot go stale when code moves.

The docs checked are the ones a user or contributor reads as a map: README.md, CONTRIBUTING.md,
bench/README.md and docs/*.md. Three kinds of names are checked:

- paths under the repository's top-level folders (``orchestrator/node/supervisor.py``,
  ``bench/results/cpu-2core/opara.json``, ``tests/orchestrator/node/test_launcher.py``); a path written
  as a script's module (``bench/stage_cost``) may stand for ``bench/stage_cost.py``; a path with a
  placeholder (``tests/<pkg>/test_<module>.py``, ``stage_cost_s39_{before,after}.json``) must match at
  least one file;
- dotted module names (``orchestrator.worker.serving.TracedRequest``, ``python -m bench.oip``): the
  longest prefix that is a module must exist and the next name must be defined at its top level (or be
  a submodule);
- relative Markdown links (``[opara.md](opara.md)``);
- class names in backquotes (``TensorLoop``, ``reconfig.ChangeHost``, ``LocalPort.submit(...)``): each
  is a word of the repository's code, so a renamed class cannot stay named in a doc.

What is left out, each with its reason, is in ``NOT_CHECKED`` and ``NOT_PATHS``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Docs read as a record of runs on named commits, not as a map: what they name is what that commit had.
NOT_CHECKED = {
    "docs/test-durations.md": "a log of timed test runs on named commits; its test ids are those commits' tests",
}

#: Text that looks like a path or a module but is not one, with why.
NOT_PATHS = {
    "native/python": "a ratio's name (native over Python), in CONTRIBUTING.md's `ingest` summary keys",
    "apps.yaml": "the config file's name, not the module apps.yaml",
}

#: A results path with a placeholder (``bench/results/<gpu>/dma.json``) names where a run on some machine
#: writes its result, not a file in git (no GPU run is committed yet): only the folder is checked.
RESULTS_TO_COME = "bench/results/"

#: Class-like names in backquotes that are not the project's and not in its code, with why.
NOT_CLASSES = {
    "IsCapturing": "CUDA's cudaStreamIsCapturing, written as a suffix after cudaStreamBeginCapture",
    "ExecDestroy": "CUDA's cudaGraphExecDestroy, written as a suffix after cudaGraphInstantiate",
    "WrongThread": "CUDA's cudaErrorStreamCaptureWrongThread, written as a suffix",
    "AddExternalInitializers": "ONNX Runtime's C API call, named beside its Python binding",
}

TOP = ("orchestrator", "gpuprims", "apps", "bench", "tests", "native", "scripts", "examples", "docs")
_PATH = re.compile(rf"(?<![\w./<>-])((?:{'|'.join(TOP)})/(?:\{{[^}}\s]*\}}|[^\s`'\"()\[\],;:|{{]+)*)")
_MODULE = re.compile(r"(?<![\w./<>-])((?:orchestrator|gpuprims|apps|bench)(?:\.[A-Za-z_]\w*)+)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_SPAN = re.compile(r"`([^`\n]+)`")
_CLASS = re.compile(r"(?<![\w-])([A-Z][a-z0-9]+[A-Z]\w*)")
_CODE_SUFFIXES = {".py", ".pyi", ".cpp", ".h", ".cu", ".proto", ".sh"}
_PLACEHOLDER = re.compile(r"<[^>]*>|\*")


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Named:
    """One name a doc gives, where it gives it."""

    doc: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _expand(text: str) -> list[str]:
    """Brace alternatives spelt out: ``a_{x,y}.json`` -> ``a_x.json``, ``a_y.json``."""
    m = re.search(r"\{([^}]*)\}", text)
    if m is None:
        return [text]
    return [e for alt in m.group(1).split(",") for e in _expand(text[:m.start()] + alt + text[m.end():])]


def _path_exists(text: str) -> bool:
    """Every spelling of the path exists; one with a placeholder (``<pkg>``, ``*``) matches a file."""
    for one in _expand(text.rstrip(".")):
        if _PLACEHOLDER.search(one):
            if one.startswith(RESULTS_TO_COME):
                ok = (ROOT / RESULTS_TO_COME).is_dir()
            else:
                ok = any(ROOT.glob(_PLACEHOLDER.sub("*", one).rstrip("/")))
        else:
            path = ROOT / one.rstrip("/")
            ok = path.exists() or path.with_name(path.name + ".py").is_file()
        if not ok:
            return False
    return True


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for cand in (base.with_name(base.name + ".py"), base.with_name(base.name + ".pyi"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    """Names a module binds at its top level: definitions, assignments, imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def _module_exists(text: str) -> bool:
    """The longest prefix of a dotted name that is a module exists, and the next part is in it."""
    parts = text.split(".")
    for k in range(len(parts), 0, -1):
        path = _module_file(parts[:k])
        if path is None:
            continue
        if k == len(parts):
            return True
        nxt = parts[k]
        return nxt in _top_level_names(path) or (path.name == "__init__.py" and (path.parent / nxt).exists())
    return False


def _link_exists(doc: Path, target: str) -> bool:
    target = target.partition("#")[0]
    if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # an anchor in the page, or a URL
        return True
    return (doc.parent / target).exists()


@cache
def _code_words() -> frozenset[str]:
    """Every identifier-like word of the repository's source files."""
    words: set[str] = set()
    for top in TOP:
        for path in (ROOT / top).rglob("*"):
            if (path.suffix in _CODE_SUFFIXES and "results" not in path.parts and path.is_file()
                    and path != Path(__file__).resolve()):  # this file names stale classes on purpose
                words |= set(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
    return frozenset(words)


def stale_names(doc: str, text: str) -> list[Named]:
    """Every path, module and relative link ``text`` (the contents of ``doc``) names that does not exist."""
    out: list[Named] = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in _PATH.finditer(line):
            name = m.group(1).rstrip(".")
            if name not in NOT_PATHS and not _path_exists(name):
                out.append(Named(doc, i, name))
        for m in _MODULE.finditer(line):
            if m.group(1) not in NOT_PATHS and not _module_exists(m.group(1)):
                out.append(Named(doc, i, m.group(1)))
        for m in _LINK.finditer(line):
            if not _link_exists(ROOT / doc, m.group(1)):
                out.append(Named(doc, i, f"link {m.group(1)}"))
        for span in _SPAN.findall(line):
            for name in _CLASS.findall(span):
                if name not in NOT_CLASSES and name not in _code_words():
                    out.append(Named(doc, i, f"class {name}"))
    return out


def named_count(text: str) -> int:
    return sum(len(_PATH.findall(line)) + len(_MODULE.findall(line)) for line in text.splitlines())


DOCS = [d for d in _docs() if str(d.relative_to(ROOT)) not in NOT_CHECKED]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    rel = str(doc.relative_to(ROOT))
    stale = stale_names(rel, doc.read_text())
    assert not stale, (f"{rel} names what does not exist (moved or renamed? update the doc):\n"
                       + "\n".join(map(str, stale)))


def test_the_docs_name_the_code_they_map() -> None:
    """The map names the modules of every room (so a pattern that stopped matching would be seen)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert named_count(text) > 50
    for room in ("control", "config", "worker", "node", "cli", "frontdoor", "fleet"):
        assert f"orchestrator/{room}/" in text, f"docs/architecture.md does not name orchestrator/{room}/"


def test_every_doc_left_out_exists_and_says_why() -> None:
    for doc, why in NOT_CHECKED.items():
        assert (ROOT / doc).is_file() and why, doc


@pytest.mark.parametrize(("text", "stale"), [
    ("the ingest (`gpuprims/ingest.py`) and `gpuprims/responder.py`", ["gpuprims/responder.py"]),
    ("run `python -m bench.oip`, not `python -m bench.no_such_bench`", ["bench.no_such_bench"]),
    ("`gpuprims.pool.PacketPool` and `gpuprims.pool.NoSuchPool`", ["gpuprims.pool.NoSuchPool", "class NoSuchPool"]),
    ("`gpuprims.cuda.event` beside `gpuprims.cuda.nosuch`", ["gpuprims.cuda.nosuch"]),
    ("scripts `bench/stage_cost`, `bench/no_such_bench`", ["bench/no_such_bench"]),
    ("`tests/<pkg>/test_<module>.py` and `tests/<pkg>/nothing_<x>.rs`", ["tests/<pkg>/nothing_<x>.rs"]),
    ("[opara](opara.md), [gone](gone.md), [web](https://example.org/x.md), [here](#layers)", ["link gone.md"]),
    ("ratio (native/python) in apps.yaml", []),
    ("`PacketPool`, `LocalPort.submit(rows)`, `IpcHandle`, `NoSuchLoop.run()`", ["class IpcHandle", "class NoSuchLoop"]),
    ("`reconfig.NoSuchHost` and `x = PacketPool(...)`, not-code CamelCase", ["class NoSuchHost"]),
    ("`stage_cost_{before,after}.json` in `bench/results/<gpu>/{dma,sync}.json`", []),
    ("`bench/results/cpu-2core/{opara,nosuch}.json`", ["bench/results/cpu-2core/{opara,nosuch}.json"]),
])
def test_the_check_finds_a_stale_name(text: str, stale: list[str]) -> None:
    assert [n.text for n in stale_names("docs/architecture.md", text)] == stale


def test_every_page_of_docs_is_on_the_map() -> None:
    """README.md (its Documentation list) or CONTRIBUTING.md names every page of docs/."""
    text = (ROOT / "README.md").read_text() + (ROOT / "CONTRIBUTING.md").read_text()
    unlisted = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in text]
    assert not unlisted, f"pages of docs/ that README.md and CONTRIBUTING.md do not name: {unlisted}"
