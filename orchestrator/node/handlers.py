"""What the node does with each control message: one handler per message type, found in a table.

:func:`handle` looks the message's type up in :data:`HANDLERS`; a type the table does not name is
ignored (the channel has already checked its token and direction). Instances send Heartbeat, Ready,
BatchDone, Ended and Error; commands (``gpuprims-orchestrator status|stop|set-gpu``) send StatusRequest,
StopRequest and SetGpuRequest and are answered exactly once through :meth:`ControlHost.reply`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from orchestrator.control.channel import Incoming
from orchestrator.control.errors import ChangeError
from orchestrator.control.messages import (
    BatchDone,
    Ended,
    Error,
    Heartbeat,
    Ready,
    Result,
    SetGpuRequest,
    StatusReply,
    StatusRequest,
    StopRequest,
)
from orchestrator.node.dispatch import LiveScheduler
from orchestrator.node.reconfig import Change
from orchestrator.node.state import AppState, InstanceTable, Role
from orchestrator.node.supervisor import Supervisor

log = logging.getLogger("gpuprims.node")


class ControlHost(Protocol):
    """What the handlers read and ask of the node (:class:`orchestrator.node.node.Node` has it)."""

    apps: dict[str, AppState]
    instances: InstanceTable
    supervisor: Supervisor | None
    dispatcher: LiveScheduler | None

    def status(self) -> dict[str, Any]: ...
    def request_stop(self, drain: bool = True) -> None: ...
    def set_gpu(self, app: str, gpu_pct: int) -> Change: ...
    def reply(self, item: Incoming, msg: Any) -> None: ...


def _sup(node: ControlHost) -> Supervisor:
    assert node.supervisor is not None, "instance messages arrive only once the supervisor is up"
    return node.supervisor


def on_heartbeat(node: ControlHost, item: Incoming) -> None:
    msg: Heartbeat = item.msg
    st = node.instances.get(msg.instance)
    if st is not None:
        now = time.monotonic()
        st.stats, st.last_beat = node.apps[st.app].stats.beat(st.name, msg.stats, now), now


def on_ready(node: ControlHost, item: Incoming) -> None:
    """An instance is up (its first Ready), pre-warmed (a shadow's warm Ready) or initialised (a shadow
    told InitGpu); "ready" is logged once per instance, at the first."""
    msg: Ready = item.msg
    st = node.instances.get(msg.instance)
    if st is None:
        return
    first = not st.ready
    Supervisor.mark_ready(st, msg)
    sup = _sup(node)
    if st.role == Role.ACTIVE:
        sup.route(st.app)
        if node.dispatcher is not None:
            node.dispatcher.bind(st.app, st.name, st.spec.consumer)
    elif st.role == Role.SHADOW:
        sup.shadow_ok(st.app)
    elif st.role == Role.OVERFLOW:
        sup.overflow_ok(st)
    if first:
        log.info("%s ready (pid %d)", msg.instance, msg.pid)
    else:
        log.debug("%s ready again (%s)", msg.instance, "initialised" if st.initialized else
                  f"pre-warm {msg.info.get('prewarm')}")


def on_batch_done(node: ControlHost, item: Incoming) -> None:
    msg: BatchDone = item.msg
    if node.dispatcher is not None and msg.instance in node.instances:
        node.dispatcher.on_done(msg)


def on_ended(node: ControlHost, item: Incoming) -> None:
    msg: Ended = item.msg
    st = node.instances.get(msg.instance)
    if st is not None:
        st.ended = True
        log.info("%s ended after draining %d request(s)", msg.instance, msg.drained_count)


def on_error(node: ControlHost, item: Incoming) -> None:
    msg: Error = item.msg
    _sup(node).reported(msg.instance, f"{msg.kind}: {msg.message}")
    log.error("instance %s reported %s: %s", msg.instance, msg.kind, msg.message)


def on_status(node: ControlHost, item: Incoming) -> None:
    node.reply(item, StatusReply(status=node.status()))


def on_stop(node: ControlHost, item: Incoming) -> None:
    msg: StopRequest = item.msg
    node.reply(item, Result(ok=True, message="stopping"))
    node.request_stop(drain=msg.drain)


def on_set_gpu(node: ControlHost, item: Incoming) -> None:
    msg: SetGpuRequest = item.msg
    try:
        ch = node.set_gpu(msg.app, msg.gpu_pct)
    except ChangeError as e:
        node.reply(item, Result(ok=False, message=str(e)))
        return
    text = ch.message() if ch.phase.terminal else f"change {ch.id} accepted: {ch.app} {ch.from_pct}% -> {ch.to_pct}%"
    node.reply(item, Result(ok=True, message=text, data={"change": ch.to_dict()}))


#: The node's handler of each control message type.
HANDLERS: dict[type, Callable[[ControlHost, Incoming], None]] = {
    Heartbeat: on_heartbeat, Ready: on_ready, BatchDone: on_batch_done, Ended: on_ended, Error: on_error,
    StatusRequest: on_status, StopRequest: on_stop, SetGpuRequest: on_set_gpu,
}


def handle(node: ControlHost, item: Incoming) -> None:
    """Run the handler of ``item``'s message type (none: ignored)."""
    fn = HANDLERS.get(type(item.msg))
    if fn is not None:
        fn(node, item)
