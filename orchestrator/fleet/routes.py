"""The fleet's routing table over HTTP: ``GET /fleet/routes`` answers the table as JSON.

Each agent serves its copy this way (clients and every node's front door fetch it from any machine,
docs/fleet.md); ``bench.forward`` and the front door's forwarding tests serve a table of their own the
same way. A thread of its own, so the answer does not wait for anything the owner is doing.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATH = "/fleet/routes"


class RoutesServer:
    """Serves ``table()`` (read at each request) at ``http://host:port/fleet/routes``; 404 elsewhere."""

    def __init__(self, table: Callable[[], Mapping[str, Any]], host: str = "127.0.0.1", port: int = 0) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.rstrip("/") != PATH:
                    self.send_error(404, f"only GET {PATH}")
                    return
                body = json.dumps(table()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return

        cls = type("Server", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6 if ":" in host
                                                      else socket.AF_INET, "daemon_threads": True})
        self._server = cls((host, port), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        threading.Thread(target=self._server.serve_forever, name="gpuprims-fleet-routes", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
