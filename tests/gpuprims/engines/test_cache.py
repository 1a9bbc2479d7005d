"""The engine cache: entries appear whole, corrupt ones are rebuilt with a WARNING, concurrent builders
build once, the root follows the environment, and the fingerprint moves with every part of the key."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest

from gpuprims.engines import EngineCache, EngineError, ModelSource, Target, default_root, fingerprint
from gpuprims.engines.cache import (
    MANIFEST,
    device_identity,
    library_versions,
    model_identity,
    weights_digest,
)

KEY = "0123456789abcdef0123456789abcdef"
PAYLOAD = b"engine artefact " * 64


def _writer(calls: list[Path]) -> Any:
    def build(tmp: Path) -> dict[str, Any]:
        calls.append(tmp)
        (tmp / "model.bin").write_bytes(PAYLOAD)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "extra.txt").write_text("x")
        return {"note": "built"}

    return build


def test_hit_after_build(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    calls: list[Path] = []
    first = cache.get_or_build(KEY, _writer(calls))
    assert not first.hit and first.build_ms >= 0.0 and first.meta == {"note": "built"}
    assert first.file("model.bin").read_bytes() == PAYLOAD
    second = cache.get_or_build(KEY, _writer(calls))
    assert second.hit and len(calls) == 1
    assert second.meta == {"note": "built"} and second.file("sub/extra.txt").read_text() == "x"
    assert second.build_ms == pytest.approx(first.build_ms, abs=0.1)
    assert cache.entries() == [KEY]
    assert cache.lookup(KEY) is not None and cache.lookup("f" * 32) is None


def test_entry_appears_whole(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    seen: list[bool] = []

    def build(tmp: Path) -> None:
        (tmp / "half").write_bytes(b"x")
        seen.append((tmp_path / KEY).exists())  # nothing under the key while building

    cache.get_or_build(KEY, build)
    assert seen == [False] and cache.check(KEY) == (True, "")


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)

    def build(tmp: Path) -> None:
        (tmp / "half").write_bytes(b"half an artefact")
        raise RuntimeError("exporter exploded")

    with pytest.raises(RuntimeError, match="exporter exploded"):
        cache.get_or_build(KEY, build)
    assert cache.entries() == [] and cache.lookup(KEY) is None
    assert list((tmp_path / "tmp").iterdir()) == []
    calls: list[Path] = []
    assert not cache.get_or_build(KEY, _writer(calls)).hit and len(calls) == 1


def _truncate(entry: Path) -> None:
    (entry / "model.bin").write_bytes(PAYLOAD[:10])


def _flip(entry: Path) -> None:  # same size, other bytes
    (entry / "model.bin").write_bytes(PAYLOAD[::-1])


def _missing(entry: Path) -> None:
    (entry / "sub" / "extra.txt").unlink()


def _not_json(entry: Path) -> None:
    (entry / MANIFEST).write_text("{not json")


def _no_manifest(entry: Path) -> None:
    (entry / MANIFEST).unlink()


def _manifest_list(entry: Path) -> None:
    (entry / MANIFEST).write_text("[]")


def _files_list(entry: Path) -> None:
    m = json.loads((entry / MANIFEST).read_text())
    m["files"] = ["model.bin"]
    (entry / MANIFEST).write_text(json.dumps(m))


def _other_key(entry: Path) -> None:
    m = json.loads((entry / MANIFEST).read_text())
    m["key"] = "f" * 32
    (entry / MANIFEST).write_text(json.dumps(m))


def _entry_is_file(entry: Path) -> None:
    import shutil

    shutil.rmtree(entry)
    entry.write_bytes(b"not a directory")


@pytest.mark.parametrize("damage", [_truncate, _flip, _missing, _not_json, _no_manifest, _manifest_list,
                                    _files_list, _other_key, _entry_is_file])
def test_corrupt_entry_is_rebuilt_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                               damage: Any) -> None:
    cache = EngineCache(tmp_path)
    calls: list[Path] = []
    cache.get_or_build(KEY, _writer(calls))
    damage(tmp_path / KEY)
    ok, why = cache.check(KEY)
    assert not ok and why
    assert cache.lookup(KEY) is None
    with caplog.at_level(logging.WARNING, logger="gpuprims.engines"):
        entry = cache.get_or_build(KEY, _writer(calls))
    assert not entry.hit and len(calls) == 2
    assert entry.file("model.bin").read_bytes() == PAYLOAD and cache.check(KEY) == (True, "")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and KEY in warnings[0].getMessage() and "rebuilding" in warnings[0].getMessage()


def test_leftovers_of_a_dead_builder_are_cleared(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    (tmp_path / "tmp").mkdir(parents=True)
    dead = tmp_path / "tmp" / f"{KEY}.99999.deadbeef"  # a builder killed mid-build left this
    dead.mkdir()
    (dead / "half").write_bytes(b"x")
    cache.get_or_build(KEY, _writer([]))
    assert not dead.exists()


def test_unwritable_root_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(EngineError, match=r"cannot be created.*GPUPRIMS_ENGINE_CACHE"):
        EngineCache(blocker / "cache").get_or_build(KEY, _writer([]))


# -- two processes, one key ---------------------------------------------------------------------------------
def _wait_for(path: Path, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {deadline_s} s")
        time.sleep(0.01)


def _concurrent_builder(root: str, sync: str, name: str, out: Any) -> None:
    """Run in a spawned process: get_or_build the same key; the build announces itself and holds until
    the parent releases it, so the other process is seen waiting on the lock meanwhile."""
    sync_dir = Path(sync)

    def build(tmp: Path) -> dict[str, Any]:
        with open(sync_dir / "builds", "a") as f:
            f.write(name + "\n")
        (sync_dir / f"building.{name}").touch()
        _wait_for(sync_dir / "release", 60.0)
        (tmp / "model.bin").write_bytes(PAYLOAD)
        return {"builder": name}

    def progress(message: str, fraction: float | None) -> None:
        (sync_dir / f"waiting.{name}").touch()

    try:
        entry = EngineCache(root).get_or_build(KEY, build, progress=progress)
        out.put((name, entry.hit, entry.meta["builder"], entry.file("model.bin").read_bytes() == PAYLOAD))
    except BaseException as e:
        out.put((name, "error", repr(e), False))


def test_two_processes_build_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    root, sync = tmp_path / "cache", tmp_path / "sync"
    sync.mkdir()
    a = ctx.Process(target=_concurrent_builder, args=(str(root), str(sync), "a", out))
    b = ctx.Process(target=_concurrent_builder, args=(str(root), str(sync), "b", out))
    try:
        a.start()
        _wait_for(sync / "building.a", 120.0)  # a holds the lock and is building
        b.start()
        _wait_for(sync / "waiting.b", 120.0)  # b is blocked on the lock (it says so through progress)
        (sync / "release").touch()
        results = sorted(out.get(timeout=120.0) for _ in range(2))
        a.join(timeout=60.0)
        b.join(timeout=60.0)
    finally:
        for p in (a, b):
            if p.is_alive():
                p.kill()
            p.join(timeout=10.0)
    assert results == [("a", False, "a", True), ("b", True, "a", True)]
    assert (sync / "builds").read_text() == "a\n"
    assert a.exitcode == 0 and b.exitcode == 0
    assert EngineCache(root).check(KEY) == (True, "")


# -- where the cache lives ------------------------------------------------------------------------------------
def test_default_root_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPRIMS_ENGINE_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "explicit"
    assert EngineCache().root == tmp_path / "explicit"
    monkeypatch.delenv("GPUPRIMS_ENGINE_CACHE")
    assert default_root() == tmp_path / "xdg" / "gpuprims" / "engines"
    monkeypatch.setenv("GPUPRIMS_ENGINE_CACHE", "")  # empty means unset
    assert default_root() == tmp_path / "xdg" / "gpuprims" / "engines"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says to ignore a relative path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_root() == tmp_path / "home" / ".cache" / "gpuprims" / "engines"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_root() == tmp_path / "home" / ".cache" / "gpuprims" / "engines"


# -- the key ---------------------------------------------------------------------------------------------------
def test_fingerprint_is_stable_and_order_free() -> None:
    a = fingerprint({"x": 1, "y": [1, 2], "z": {"p": "q", "r": None}})
    b = fingerprint({"z": {"r": None, "p": "q"}, "y": [1, 2], "x": 1})
    assert a == b and len(a) == 32 and int(a, 16) >= 0


def _parts(source: ModelSource, target: Target, kind: str = "onnxruntime",
           options: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"kind": kind, "options": options or {"provider": "cpu"}, "model": model_identity(source),
            "device": device_identity(target), "libs": library_versions("onnxruntime")}


def test_fingerprint_changes_with_each_part() -> None:
    base = ModelSource("mobilenet_v2", (3, 64, 64), max_batch=4)
    cpu = Target("cpu", threads=1)
    ref = fingerprint(_parts(base, cpu))
    assert fingerprint(_parts(ModelSource("mobilenet_v2", (3, 64, 64), max_batch=4), Target("cpu"))) == ref
    variants = {
        "model": ModelSource("resnet18", (3, 64, 64), max_batch=4),
        "seed": ModelSource("mobilenet_v2", (3, 64, 64), max_batch=4, seed=1),
        "classes": ModelSource("mobilenet_v2", (3, 64, 64), max_batch=4, num_classes=10),
        "shape": ModelSource("mobilenet_v2", (3, 96, 64), max_batch=4),
        "max_batch": ModelSource("mobilenet_v2", (3, 64, 64), max_batch=8),
    }
    keys = {name: fingerprint(_parts(src, cpu)) for name, src in variants.items()}
    keys["kind"] = fingerprint(_parts(base, cpu, kind="compile"))
    keys["options"] = fingerprint(_parts(base, cpu, options={"provider": "cpu", "optimization": "basic"}))
    libs = _parts(base, cpu)
    libs["libs"] = {**libs["libs"], "onnxruntime": "0.0.1"}
    keys["library"] = fingerprint(libs)
    dev = _parts(base, cpu)
    dev["device"] = {**dev["device"], "cpu": "another CPU"}
    keys["device"] = fingerprint(dev)
    assert ref not in keys.values()
    assert len(set(keys.values())) == len(keys)


def test_model_identity_of_a_user_model_is_its_weights() -> None:
    import torch

    torch.manual_seed(0)
    m1 = torch.nn.Linear(4, 2)
    m2 = torch.nn.Linear(4, 2)
    src = ModelSource("mypkg.models:build", (1, 1, 4), max_batch=2)
    id1, id2 = model_identity(src, m1), model_identity(src, m2)
    assert "zoo_code" not in id1 and id1["weights"] == weights_digest(m1)
    assert fingerprint(id1) != fingerprint(id2)
    with torch.no_grad():
        m2.load_state_dict(m1.state_dict())
    assert model_identity(src, m2) == id1
    assert "zoo_code" in model_identity(ModelSource("resnet18", (3, 32, 32), max_batch=1))


def test_device_identity_names_the_device(fake_cuda: Any) -> None:
    cpu = device_identity(Target("cpu"))
    assert cpu["backend"] == "cpu" and cpu["isa"] and device_identity(Target("cpu", threads=2)) == cpu
    gpu = device_identity(Target("cuda"))
    assert gpu["backend"] == "cuda" and gpu["fake"] and "." in gpu["cc"]
    assert fingerprint(cpu) != fingerprint(gpu)


def test_library_versions_name_each_package() -> None:
    libs = library_versions("numpy", "no-such-package-here")
    assert libs["torch"] and libs["numpy"] and libs["gpuprims"]
    assert libs["no-such-package-here"] is None


def test_entries_skip_locks_and_tmp(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "none")
    assert cache.entries() == []
    cache.get_or_build(KEY, _writer([]))
    assert cache.entries() == [KEY] and os.path.isdir(tmp_path / "none" / "locks")
