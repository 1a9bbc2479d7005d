"""Traffic tool: generate, record, replay and measure gpuprims UDP request streams.

The Python API under `gpuprims-traffic`:

>>> from gpuprims.traffic import AppStream, Stream, run
>>> report = run(Stream([AppStream(1, (224, 224, 3), "float32", rate=100, count=500,
...                                 to=("127.0.0.1", 9000))], seed=1))  # doctest: +SKIP
>>> report["answered"], report["latency_ms"]["p99"]  # doctest: +SKIP

`Stream.plan()` builds what is sent; `write_pcap`/`read_pcap`/`replay_plan` record and replay pcap;
`Sender`/`Receiver`/`Tracker` are the parts `run` drives; `EchoServer` answers on loopback.
"""

from __future__ import annotations

from gpuprims.traffic.echo import EchoServer
from gpuprims.traffic.pcap import PcapError, read_pcap, replay_plan, write_datagrams, write_pcap
from gpuprims.traffic.receiver import Receiver, Tracker
from gpuprims.traffic.report import Report
from gpuprims.traffic.runner import run
from gpuprims.traffic.sender import Sender, SocketSet, parse_port_range
from gpuprims.traffic.stream import AppStream, Plan, Stream, read_intervals

__all__ = ["AppStream", "EchoServer", "PcapError", "Plan", "Receiver", "Report", "Sender", "SocketSet", "Stream",
           "Tracker", "parse_port_range", "read_intervals", "read_pcap", "replay_plan", "run", "write_datagrams",
           "write_pcap"]
