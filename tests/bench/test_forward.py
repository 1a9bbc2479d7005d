"""bench/forward's own logic: the table it serves and the paired differences it reports."""

from __future__ import annotations

import json
import urllib.request

import numpy as np

from bench import forward
from orchestrator.frontdoor.forward import model_info_from_route


def test_the_table_routes_the_app_to_the_node_with_what_a_front_door_needs() -> None:
    entry = {"name": forward.APP, "model": "mobilenet_v2", "input_shape": list(forward.SHAPE), "slo_ms": forward.SLO_MS,
             "gpu_pct": 50, "max_batch": 8, "max_wait_ms": 2.0, "app_id": forward.APP_ID}
    table = forward.route_table(entry, 9123)
    route = table["apps"][forward.APP]
    assert route["primary"]["udp_port"] == 9123 and route["standby"] is None and route["app_id"] == forward.APP_ID
    info = model_info_from_route(forward.APP, route)
    assert info is not None and info.input_shape == forward.SHAPE and info.output_dim == 1000
    server = forward.RoutesServer(lambda: table)
    try:
        with urllib.request.urlopen(server.url + "/fleet/routes", timeout=10) as r:
            assert json.loads(r.read()) == table
    finally:
        server.close()


def test_added_latency_is_the_median_of_paired_differences_and_failures_are_left_out() -> None:
    lat = {"direct-http": [10.0, 10.0, 10.0, float("nan")], "forwarded-http": [11.0, 12.0, 10.5, 11.0],
           "direct-grpc": [5.0, 5.0, 5.0, 5.0], "forwarded-grpc": [5.5, 5.25, 5.0, 6.0]}
    s = forward.summarise(lat)
    assert s["added.http.p50_ms"] == 1.0  # median of 1, 2, 0.5 (the round with a failure left out)
    assert s["added.grpc.p50_ms"] == 0.375 and s["direct-http.p50_ms"] == 10.0
    assert np.isclose(s["added.grpc.p90_ms"], np.percentile([0.5, 0.25, 0.0, 1.0], 90), atol=1e-3)
