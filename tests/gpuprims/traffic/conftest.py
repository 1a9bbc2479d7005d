from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator

import pytest

from gpuprims.traffic import EchoServer

#: How long a run may wait for an answer before counting it late. The echo answers at once, but on a
#: busy machine (two busy loops on two cores) its thread or the receiver may not run for a while; a
#: test that counts answers gives them this long. A run ends as soon as every request is answered,
#: so a long timeout costs nothing when the answers come.
ANSWER_TIMEOUT_S = 30.0


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    with EchoServer(delay_s=0.0005) as srv:
        yield srv


@pytest.fixture
def sink() -> Iterator[socket.socket]:
    """A bound UDP socket that nobody reads: a destination for send-only runs."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    yield s
    s.close()


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package: apt-get install -y {name})")
    return path
