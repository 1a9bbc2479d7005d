"""Open Inference Protocol (KServe v2) front door: HTTP/REST and gRPC in front of the UDP ingest.

>>> door = start_frontdoor(cfg.apps, ("127.0.0.1", 9000), http_port=8000, grpc_port=8001,
...                        ingest=node.ingest)  # doctest: +SKIP
>>> door.http_url, door.grpc_target  # doctest: +SKIP
('http://127.0.0.1:8000', '127.0.0.1:8001')
>>> door.close()  # doctest: +SKIP

Given the node's ``ingest``, every inference's rows are placed straight into its packet pool and
answered back in-process (``transport.PoolTransport``); without it they are sent as wire-format
requests to the UDP ingest at ``udp_target``. Either way they share the packet pool, instances,
batching, SLO accounting and metrics with UDP clients.
docs/oip.md lists the endpoints and how statuses map to HTTP and gRPC codes.
"""

from __future__ import annotations

from orchestrator.frontdoor import oip_pb2
from orchestrator.frontdoor.core import HTTP_CODE, STATUS_ERRORS, OipError
from orchestrator.frontdoor.models import ModelInfo, model_info
from orchestrator.frontdoor.server import FrontDoor, FrontDoorError, start_frontdoor

__all__ = ["HTTP_CODE", "STATUS_ERRORS", "FrontDoor", "FrontDoorError", "ModelInfo", "OipError", "model_info",
           "oip_pb2", "start_frontdoor"]
