"""The example repository end to end (``make demo-repository``): build it, serve it, ask it, stop.

``python examples/repository_demo.py [--repository build/example-repository] [--ready-timeout 600]``:

1. builds the example Triton model repository from seeded models (examples/model_repository.py);
2. starts ``gpuprims-orchestrator start --model-repository DIR --name example-repository`` in the
   background, on the defaults a bare ``--model-repository`` node takes (UDP 9000, HTTP 8000, gRPC 8001,
   on loopback), its log in ``build/example-repository.log``;
3. waits until ``GET /v2/health/ready`` answers 200 (or the node exits, or the deadline passes);
4. asks every model over HTTP, gRPC and UDP and compares each answer with the file run directly
   (examples/repository_client.py), printing the table;
5. stops the node (``gpuprims-orchestrator stop --name example-repository``) whatever happened before,
   Ctrl-C included, and makes sure its process is gone.

Exits 0 when every answer matched, 1 when one did not or the node did not start (its log's tail is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

# The two scripts beside this one; run as a script, this directory is on sys.path already.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import model_repository
import repository_client

ROOT = Path(__file__).resolve().parent.parent
NAME = "example-repository"
#: Where a bare ``start --model-repository`` node listens (orchestrator/cli/node.py REPOSITORY_DEFAULTS).
HTTP, GRPC, UDP = "127.0.0.1:8000", "127.0.0.1:8001", ("127.0.0.1", 9000)
#: How long ``stop`` may take to drain and reap the node before its process is terminated, then killed.
STOP_TIMEOUT_S = 60.0


def _cli() -> str:
    """The ``gpuprims-orchestrator`` of this interpreter's environment (the venv's), else the one on PATH."""
    exe = Path(sys.executable).with_name("gpuprims-orchestrator")
    return str(exe) if exe.exists() else "gpuprims-orchestrator"


def _tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until_ready(node: subprocess.Popen[bytes], http: str, deadline_s: float) -> None:
    """Return once the node's ``/v2/health/ready`` answers 200; RuntimeError when the node exits first,
    TimeoutError after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        if node.poll() is not None:
            raise RuntimeError(f"the node exited with status {node.returncode} before it was ready")
        try:
            repository_client.wait_ready(http, 1.0)
            return
        except TimeoutError:
            if time.monotonic() > end:
                raise TimeoutError(f"the node was not ready within {deadline_s:.0f} s (--ready-timeout)") from None


def stop_node(node: subprocess.Popen[bytes], name: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop the node as a user would (``stop --name``: it drains and removes what it made), then make sure
    its process is gone: terminated after ``timeout_s``, killed if that does not end it; always reaped."""
    if node.poll() is None:
        try:
            subprocess.run([_cli(), "stop", "--name", name], timeout=timeout_s, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            node.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it ended in between
                os.killpg(node.pid, sig)  # the node leads its own session: its instances go with it
    node.wait()


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repository", default=str(model_repository.DEFAULT_OUT), help="where to build it (replaced)")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds the node may take to be ready")
    ap.add_argument("--name", default=NAME, help="the node's name (stop --name NAME)")
    args = ap.parse_args(argv)

    repo = model_repository.build(Path(args.repository))
    print(f"built the example repository in {repo}: {', '.join(model_repository.MODELS)}", flush=True)
    log = repo.parent / f"{repo.name}.log"
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the node as Ctrl-C does
    with open(log, "wb") as out:
        node = subprocess.Popen([_cli(), "start", "--model-repository", str(repo), "--name", args.name],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"started the node (pid {node.pid}, log {log}); waiting for http://{HTTP}/v2/health/ready", flush=True)
    try:
        try:
            wait_until_ready(node, HTTP, args.ready_timeout)
        except (RuntimeError, TimeoutError) as e:
            print(f"{e}; the node's log ends:\n{_tail(log)}", file=sys.stderr)
            return 1
        print(f"the node is ready (gpuprims-orchestrator status --name {args.name} shows it)", flush=True)
        app_ids = repository_client.app_ids_from_status(repository_client.node_status(args.name))
        rows, unavailable = repository_client.check_node(HTTP, GRPC, UDP, repo, app_ids)
        print(repository_client.format_table(rows, unavailable))
        failures = list(repository_client.iter_failures(rows, unavailable))
        if failures:
            print(f"FAILED: {', '.join(failures)}", file=sys.stderr)
            return 1
        print(f"every answer of {len({r.model for r in rows})} models over HTTP, gRPC and UDP equals the model "
              "file run directly")
        return 0
    except KeyboardInterrupt:
        print("interrupted; stopping the node", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop below runs to its end
        stop_node(node, args.name)
        print(f"stopped the node {args.name}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
