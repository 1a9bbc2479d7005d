"""What the wheel ships: the library, the orchestrator and the apps, with gpuprims' test rig as a public
testing package (``gpuprims.testing``, as torch ships ``torch.testing``), and nothing else.

Why ``gpuprims.testing`` ships rather than staying in the source tree: users select the fake CUDA
runtime at run time (``GPUPRIMS_FAKE_CUDA=1``, ``gpuprims doctor --fake``; docs/gpu-machine.md,
docs/primitives.md), and ``gpuprims doctor``'s GPU-DMA check on a real GPU fills the synthetic pool,
so an installed wheel needs both. ``gpuprims.testing.hostsim`` is left out (``wheel.exclude`` in
pyproject.toml): it compiles ``native/`` sources, which only a source checkout has. The rig stays out
of the library's layers all the same: no library module imports it (tests/test_layers.py,
GPUPRIMS_UNITS), and the CUDA layer loads the fake by name only when the variable selects it.

The fast test reads the file list as scikit-build-core makes it, from pyproject.toml's settings
(its own package walk and exclude rules, without building the extension); the `slow` one builds the
wheel and reads the archive.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pathspec
import pytest
from scikit_build_core._compat import tomllib  # tomllib, or tomli on Python 3.10
from scikit_build_core.build._editable import get_packages
from scikit_build_core.build._pathutil import packages_to_file_mapping
from scikit_build_core.settings.skbuild_read_settings import SettingsReader

ROOT = Path(__file__).resolve().parents[2]

#: Files that must be in the wheel (paths inside it).
MUST_SHIP = (
    "gpuprims/__init__.py", "gpuprims/_native.pyi", "gpuprims/_version.py", "gpuprims/backend.py",
    "gpuprims/cuda/runtime.py", "gpuprims/engines/kinds.py",
    "gpuprims/testing/__init__.py", "gpuprims/testing/fake.py", "gpuprims/testing/synthetic.py",
    "gpuprims/coexec/profiles/paper/lstm.json", "gpuprims/profile/paper/resnet50.json",
    "orchestrator/cli/main.py", "orchestrator/cli/doctor.py", "orchestrator/frontdoor/oip.proto",
    "apps/zoo/__init__.py",
)
#: Top-level folders of the wheel: the three packages and the metadata.
TOP_LEVEL = {"gpuprims", "orchestrator", "apps"}


def _settings() -> Any:  # scikit-build-core's settings record
    return SettingsReader(tomllib.loads((ROOT / "pyproject.toml").read_text()), {}, state="wheel").settings


def python_files_of_the_wheel() -> list[str]:
    """The package files scikit-build-core puts in the wheel (paths inside it), without the CMake
    install (the extension): its package walk, then wheel.exclude as it applies it when writing."""
    settings = _settings()
    stage = ROOT / "build" / "_wheel_listing"  # only joined with names, never written
    mapping = packages_to_file_mapping(
        packages=get_packages(packages=settings.wheel.packages, name="gpuprims"), platlib_dir=stage,
        include=settings.sdist.include, src_exclude=settings.sdist.exclude, target_exclude=settings.wheel.exclude,
        build_dir=settings.build_dir, mode=settings.sdist.inclusion_mode)
    exclude = pathspec.GitIgnoreSpec.from_lines(settings.wheel.exclude)
    files = (Path(target).relative_to(stage) for target in mapping.values())
    return sorted(str(f) for f in files if f.suffix not in (".pyc", ".pyo") and not exclude.match_file(f))


def _check(files: list[str]) -> None:
    names = set(files)
    missing = [f for f in MUST_SHIP if f not in names]
    assert not missing, f"files the wheel must ship are missing: {missing}"
    tops = {f.split("/")[0] for f in files if ".dist-info" not in f.split("/")[0]}
    assert tops == TOP_LEVEL, f"top-level entries besides {TOP_LEVEL}: {tops - TOP_LEVEL}"
    assert "gpuprims/testing/hostsim.py" not in names
    bad = [f for f in files if "__pycache__" in f or f.endswith((".pyc", ".cpp", ".cu", ".h", ".cmake"))]
    assert not bad, f"build leftovers or native sources in the wheel: {bad[:10]}"


def test_the_wheel_ships_the_packages_and_the_testing_rig_without_hostsim() -> None:
    files = python_files_of_the_wheel()
    _check(files)
    # The listing is the packages' source trees: every Python module of the library is there but hostsim.
    want = {str(p.relative_to(ROOT)) for p in (ROOT / "gpuprims").rglob("*.py") if "__pycache__" not in p.parts}
    assert want - set(files) == {"gpuprims/testing/hostsim.py"}


def test_the_wheel_exclude_rule_is_the_one_documented() -> None:
    assert list(_settings().wheel.exclude) == ["gpuprims/testing/hostsim.py"]


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.timeout(1800)
def test_a_built_wheel_holds_what_the_listing_says_and_the_extension(tmp_path: Path) -> None:
    """Builds the wheel (the extension compiles in a build directory of its own: minutes)."""
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                        "-w", str(tmp_path / "dist"), "-C", f"build-dir={tmp_path / 'build'}", str(ROOT)],
                       capture_output=True, text=True, timeout=1500, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("gpuprims-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        files = sorted(zf.namelist())
    _check(files)
    extension = [f for f in files if f.startswith("gpuprims/_native.") and f.endswith(".so")]
    assert len(extension) == 1, f"the wheel must hold the extension once: {extension}"
    listed = set(python_files_of_the_wheel())
    shipped = {f for f in files if ".dist-info/" not in f and f not in extension}
    assert shipped == listed, (sorted(shipped - listed)[:10], sorted(listed - shipped)[:10])
