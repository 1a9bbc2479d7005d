"""Multi-Model sizing of `auto` apps from profiles, and the shares the node assigns (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.schema import parse_config
from orchestrator.node.node import AppState, Node, StartError


def profile(model: str, lat: dict[tuple[int, int], float]) -> dict[str, Any]:
    pts = [{"batch_size": b, "gpu_pct": p, "latency_p50_ms": ms, "latency_p99_ms": ms * 1.05,
            "peak_mem_mb": 10.0, "throughput_rps": b * 1000 / ms} for (b, p), ms in sorted(lat.items())]
    return {"format_version": 1, "model": model, "source": "synthetic", "source_note": "test", "backend": "cpu",
            "device": "test", "versions": {}, "conditions": {"input_shape": [3, 32, 32], "dtype": "float32",
                                                            "date": "2026-11-21", "repeats": 1}, "points": pts}


def node_for(apps: list[dict[str, Any]], profiles_dir: Path | None = None, **node: Any) -> Node:
    n: dict[str, Any] = {"backend": "cpu", **node}
    if profiles_dir is not None:
        n["profiles"] = str(profiles_dir)
    cfg = parse_config({"node": n, "apps": apps}, source="test")
    nd = Node(cfg)
    for app in cfg.apps:
        nd.apps[app.name] = AppState(cfg=app, gpu_pct=0, instances=app.instances if isinstance(app.instances, int) else 1)
    return nd


def test_multi_model_sizes_auto_instances_from_the_profile(tmp_path: Path) -> None:
    # Latency barely changes above 25%: four 25% instances give about 4x the throughput of one 100%.
    lat = {(1, p): 10.0 + (40.0 if p < 25 else 0.0) for p in (10, 25, 50, 75, 100)}
    (tmp_path / "m.json").write_text(json.dumps(profile("mobilenet_v2", lat)))
    nd = node_for([{"name": "a", "model": "mobilenet_v2", "slo_ms": 30, "instances": "auto", "gpu_pct": "auto",
                    "max_batch": 1}], tmp_path)
    nd.placement.size_auto_apps()
    nd.placement.assign_pcts()
    a = nd.apps["a"]
    assert (a.instances, a.gpu_pct) == (4, 25)


def test_auto_without_profile_runs_one_instance_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nd = node_for([{"name": "a", "model": "resnet18", "slo_ms": 30, "instances": "auto"}], tmp_path)
    nd.placement.size_auto_apps()
    nd.placement.assign_pcts()
    assert nd.apps["a"].instances == 1 and nd.apps["a"].gpu_pct == 100
    assert "no profile of resnet18" in caplog.text


def test_auto_pct_splits_what_fixed_apps_leave() -> None:
    nd = node_for([{"name": "a", "model": "resnet18", "slo_ms": 30, "gpu_pct": 40},
                   {"name": "b", "model": "resnet18", "slo_ms": 30},
                   {"name": "c", "model": "resnet18", "slo_ms": 30, "instances": 2}])
    nd.placement.assign_pcts()
    assert [nd.apps[n].gpu_pct for n in "abc"] == [40, 20, 20]


def test_bad_profile_is_refused_with_its_file(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"format_version": 1}')
    nd = node_for([{"name": "a", "model": "resnet18", "slo_ms": 30, "instances": "auto"}], tmp_path)
    with pytest.raises(StartError, match=r"bad\.json"):
        nd.placement.size_auto_apps()


def test_live_scheduler_needs_one_instance_per_app(tmp_path: Path) -> None:
    cfg = parse_config({"node": {"backend": "cpu", "scheduler": "temporal", "run_dir": str(tmp_path / "run")},
                        "apps": [{"name": "a", "model": "resnet18", "slo_ms": 30, "instances": 2}]}, source="test")
    with pytest.raises(StartError, match=r"one instance per app.*instances: 1 for a"):
        Node(cfg).start()
