"""Helpers the fleet's tests share."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any


def post_until_ok(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST ``body`` as JSON until it is answered 200, and return the answer. A 404 is retried until
    ``timeout_s``: a node's front door fetches its agent's routing table every second, so a model it
    forwards is unknown to it until then."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return dict(json.loads(resp.read()))
        except urllib.error.HTTPError as e:
            if e.code != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.2)
