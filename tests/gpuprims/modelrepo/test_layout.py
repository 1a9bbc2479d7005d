"""The repository on disk: models, version directories and policies, model files, fingerprints, and a
broken model beside good ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuprims.modelrepo import RepositoryError, RepositoryModel, fingerprint, load_model, read_model, scan
from tests.gpuprims.modelrepo import onnxmodels

CONFIG = """\
platform: "onnxruntime_onnx"
max_batch_size: 0
input { name: "in" data_type: TYPE_FP32 dims: [ 2, 3 ] }
output { name: "total" data_type: TYPE_FP32 dims: [ 2 ] }
"""


def _model(repo: Path, name: str, versions: tuple[int | str, ...] = (1,), config: str | None = CONFIG,
           filename: str = "model.onnx") -> Path:
    d = repo / name
    d.mkdir(parents=True)
    if config is not None:
        (d / "config.pbtxt").write_text(config)
    for v in versions:
        onnxmodels.fixed(d / str(v) / filename)
    return d


def test_a_broken_model_beside_good_ones(tmp_path: Path) -> None:
    _model(tmp_path, "good")
    _model(tmp_path, "auto", config=None)
    _model(tmp_path, "bad_config", config=CONFIG + "sequence_batching { }\n")
    _model(tmp_path, "no_versions", versions=())
    _model(tmp_path, "no_file", filename="other.onnx")
    _model(tmp_path, "named_wrong", config='name: "other"\n' + CONFIG)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README.txt").write_text("not a model")
    models = scan(tmp_path)
    by = {m.name: m for m in models}
    assert [m.name for m in models] == sorted(by) == ["auto", "bad_config", "good", "named_wrong", "no_file",
                                                      "no_versions"]
    for name in ("good", "auto"):
        m = by[name]
        assert m.ok and m.error is None and m.config is not None and m.config.name == name
        assert list(m.versions) == [1] and m.latest is not None and m.latest.version == 1
        assert m.latest.model_path == str(tmp_path / name / "1" / "model.onnx")
    assert by["auto"].config_digest is None and by["good"].config_digest is not None
    d = tmp_path
    assert by["bad_config"].error == (f"{d / 'bad_config' / 'config.pbtxt'}:5: sequence_batching: refused: stateful "
                                      "(sequence) models are not supported")
    assert by["no_versions"].error is not None and by["no_versions"].error.startswith(
        f"{d / 'no_versions'}: version: no version directory")
    assert by["no_file"].error == (f"{d / 'no_file' / '1'}: default_model_filename: version 1 has no model file "
                                   "'model.onnx' (onnx)")
    assert by["named_wrong"].error == (f"{d / 'named_wrong' / 'config.pbtxt'}:1: name: 'other' differs from its "
                                       "directory's name 'named_wrong' (Triton's rule: a model is named by its "
                                       "directory)")
    for name in ("bad_config", "no_versions", "no_file", "named_wrong"):
        m = by[name]
        assert not m.ok and m.config is None and m.versions == {} and m.latest is None and "\n" not in str(m.error)


@pytest.mark.parametrize(("policy", "served"), [
    ("", [10]),
    ("version_policy: { latest: { num_versions: 2 } }", [3, 10]),
    ("version_policy: { latest: { num_versions: 9 } }", [1, 2, 3, 10]),
    ("version_policy: { all: { } }", [1, 2, 3, 10]),
    ("version_policy: { specific: { versions: [ 1, 3 ] } }", [1, 3]),
])
def test_version_policies_pick_the_versions_served(tmp_path: Path, policy: str, served: list[int]) -> None:
    d = _model(tmp_path, "m", versions=(1, 2, 3, 10), config=CONFIG + policy)
    for ignored in ("0", "01", "v4", "4a"):  # Triton ignores these directories
        onnxmodels.fixed(d / ignored / "model.onnx")
    m = read_model(d)
    assert m.ok, m.error
    assert list(m.versions) == served and m.latest is not None and m.latest.version == served[-1]
    assert all(v.directory == str(d / str(n)) for n, v in m.versions.items())


def test_a_specific_version_without_a_directory_fails_the_model(tmp_path: Path) -> None:
    d = _model(tmp_path, "m", versions=(1, 2), config=CONFIG + "version_policy: { specific: { versions: [ 2, 5 ] } }")
    m = read_model(d)
    assert m.error == (f"{d / 'config.pbtxt'}: version_policy: specific 2,5: versions [5] have no directory "
                       "(present: [1, 2])")


def test_only_served_versions_need_their_file(tmp_path: Path) -> None:
    d = _model(tmp_path, "m", versions=(2,))
    (d / "1").mkdir()  # an old version without its file: not served under latest 1
    assert read_model(d).ok
    m = read_model(_model(tmp_path, "n", versions=(2,), config=CONFIG + "version_policy: { all: { } }"))
    assert m.ok
    (tmp_path / "n" / "1").mkdir()
    m = read_model(tmp_path / "n")
    assert m.error is not None and "version 1 has no model file 'model.onnx'" in m.error


def test_default_model_filename_and_an_onnx_directory(tmp_path: Path) -> None:
    d = _model(tmp_path, "custom", config=CONFIG + 'default_model_filename: "net.onnx"', filename="net.onnx")
    m = read_model(d)
    assert m.ok and m.latest is not None and m.latest.model_path == str(d / "1" / "net.onnx")
    # Triton's layout for an ONNX model with external data: model.onnx/ is a directory holding model.onnx.
    e = tmp_path / "ext"
    (e).mkdir()
    (e / "config.pbtxt").write_text(CONFIG)
    onnxmodels.fixed(e / "1" / "model.onnx" / "model.onnx")
    (e / "1" / "model.onnx" / "weights.bin").write_bytes(b"\0" * 16)
    m = read_model(e)
    assert m.ok and m.latest is not None and m.latest.model_path == str(e / "1" / "model.onnx" / "model.onnx")


def test_fingerprints_follow_content_not_time_or_place(tmp_path: Path) -> None:
    a = _model(tmp_path / "r1", "m")
    b = _model(tmp_path / "r2", "m")
    fa, fb = read_model(a).latest, read_model(b).latest
    assert fa is not None and fb is not None and fa.fingerprint == fb.fingerprint  # same bytes, elsewhere
    assert len(fa.fingerprint) == 64 and fa.fingerprint == fingerprint(a / "1")
    os.utime(a / "1" / "model.onnx", (1, 1))
    assert fingerprint(a / "1") == fa.fingerprint  # time does not count
    (a / "1" / "extra.bin").write_bytes(b"x")
    f_extra = fingerprint(a / "1")
    assert f_extra != fa.fingerprint  # a new file counts
    (a / "1" / "extra.bin").rename(a / "1" / "other.bin")
    assert fingerprint(a / "1") not in (fa.fingerprint, f_extra)  # a name counts
    (a / "1" / "other.bin").unlink()
    data = bytearray((a / "1" / "model.onnx").read_bytes())
    data[-1] ^= 1
    (a / "1" / "model.onnx").write_bytes(bytes(data))
    assert fingerprint(a / "1") != fa.fingerprint  # one bit counts


def test_the_model_digest_follows_config_and_versions(tmp_path: Path) -> None:
    d = _model(tmp_path, "m", versions=(1,))
    first = read_model(d).digest
    assert read_model(d).digest == first
    (d / "config.pbtxt").write_text(CONFIG + "dynamic_batching { }\n")
    second = read_model(d).digest
    assert second != first
    onnxmodels.multi(d / "2" / "model.onnx")  # a new version (completion not needed: the config lists tensors)
    assert read_model(d).digest != second


def test_load_model_by_name(tmp_path: Path) -> None:
    _model(tmp_path, "good")
    m = load_model(tmp_path, "good")
    assert m.ok and m.name == "good"
    missing = load_model(tmp_path, "absent")
    assert missing.error == f"{tmp_path / 'absent'}: model: no model 'absent' in {tmp_path}"
    for bad in ("", ".", "..", "../good", "a/b", ".hidden", "a\\b"):
        with pytest.raises(RepositoryError, match="is not a model name"):
            load_model(tmp_path, bad)


def test_a_repository_that_is_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match="is not a directory"):
        scan(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RepositoryError, match="is not a directory"):
        load_model(tmp_path / "file", "m")
    assert scan(tmp_path) == []


def test_an_unreadable_model_or_repository_is_an_error_not_a_crash(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuprims.modelrepo import formats

    d = _model(tmp_path, "m")
    real = formats.version_dirs

    def denied(model_dir: str | Path) -> dict[int, Path]:
        if Path(model_dir) == d:
            raise PermissionError(13, "Permission denied", str(model_dir))
        return real(model_dir)

    monkeypatch.setattr(formats, "version_dirs", denied)
    m = read_model(d)
    assert m.error is not None and m.error.startswith(f"{d}: model: cannot be read: ") and "Permission denied" in m.error
    monkeypatch.setattr(Path, "iterdir", lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(RepositoryError, match="cannot be listed"):
        scan(tmp_path)


def test_records_hold_their_invariants(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a config and a version"):
        RepositoryModel("m", str(tmp_path), None)
    good = read_model(_model(tmp_path, "m"))
    with pytest.raises(ValueError, match="serves no version"):
        RepositoryModel("m", str(tmp_path), None, good.versions, "broken")


def test_the_package_imports_neither_torch_nor_onnx_nor_tensorrt() -> None:
    import subprocess
    import sys

    code = ("import sys, gpuprims.modelrepo\n"
            "bad = [m for m in ('torch', 'onnx', 'tensorrt', 'openvino') if m in sys.modules]\n"
            "print('ok' if not bad else bad)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[3])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_a_rescan_reuses_fingerprints_of_unchanged_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuprims.modelrepo import layout

    d = _model(tmp_path, "m", versions=(1, 2), config=CONFIG + "version_policy: { all: { } }")
    first = scan(tmp_path)
    read: list[str] = []
    checked: list[str] = []
    real, real_check = layout.fingerprint, layout.check_model_file
    monkeypatch.setattr(layout, "fingerprint", lambda p: read.append(Path(p).name) or real(p))
    monkeypatch.setattr(layout, "check_model_file",
                        lambda c, p, t: checked.append(Path(p).parent.name) or real_check(c, p, t))
    again = scan(tmp_path, {m.name: m for m in first})
    assert read == [] and checked == [] and again == first  # nothing read again, the same fingerprints
    import onnx

    model = onnx.load(str(d / "2" / "model.onnx"))
    model.doc_string = "retrained"
    onnx.save(model, str(d / "2" / "model.onnx"))  # a changed file: its version is read again
    third = read_model(d, again[0])
    assert third.ok, third.error
    assert read == ["2"] and checked == ["2"] and third.versions[1] == again[0].versions[1]
    assert third.versions[2].fingerprint != again[0].versions[2].fingerprint and third.digest != again[0].digest


def test_a_served_file_is_checked_against_the_config(tmp_path: Path) -> None:
    d = _model(tmp_path, "m", versions=(1, 2), config=CONFIG.replace('"in"', '"image"'))
    m = read_model(d)
    assert m.error == (f"{d / '2' / 'model.onnx'}: input[0]: the model file has no input 'image' (its "
                       "inputs: 'in')")
    assert read_model(d, check_files=False).ok  # the engine finds it later
    e = _model(tmp_path, "corrupt", versions=(1,))
    (e / "1" / "model.onnx").write_bytes(b"\x08\x07 not onnx \xff")
    m = read_model(e)
    assert m.error is not None and m.error.startswith(f"{e / '1' / 'model.onnx'}: model file: not a "
                                                      "readable ONNX model")


def test_a_warmup_data_file_must_be_in_warmup(tmp_path: Path) -> None:
    warm = ('model_warmup { name: "w" inputs { key: "in" value: { data_type: TYPE_FP32 dims: [ 2, 3 ] '
            'input_data_file: "in.bin" } } }\n')
    d = _model(tmp_path, "m", config=CONFIG + warm)
    m = read_model(d)
    assert m.error == (f"{d / 'config.pbtxt'}: model_warmup: warmup 'w': input 'in' reads 'in.bin', which is not a "
                       f"file in {d / 'warmup'}")
    (d / "warmup").mkdir()
    (d / "warmup" / "in.bin").write_bytes(b"\0" * 24)
    m = read_model(d)
    assert m.ok and m.config is not None and m.config.warmup[0].inputs[0].data_file == "in.bin"
