"""bench/launch: its arguments, and (heavy) a one-round run on real nodes that writes its result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import launch


def test_zero_rounds_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        launch.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be at least 1" in capsys.readouterr().err


@pytest.mark.heavy
def test_one_round_times_both_launchers_and_writes_its_samples(tmp_path: Path) -> None:
    assert launch.main(["--rounds", "1", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "launch.json").read_text())
    s = doc["summary"]
    assert s["rounds"] == 1 and s["fork_server_import_ms"] and all(ms > 0 for ms in s["fork_server_import_ms"])
    for name in ("process", "fork"):
        (row,) = doc["samples"][name]
        assert row["start_s"] > 0 and row["replace_s"] > 0 and s[f"{name}_start_s_p50"] == round(row["start_s"], 3)
    assert s["start_s_ratio"] > 0 and "load_avg_before" in doc["machine"]
