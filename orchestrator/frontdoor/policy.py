"""An app's admission policy at the front door: Triton's queue policy and priority levels, one record.

It comes from the app's ``admission:`` section in apps.yaml (`orchestrator.config.schema.AdmissionConfig`)
or, for a model file, from its config.pbtxt ``dynamic_batching`` (``default_queue_policy``,
``priority_levels``, ``default_priority_level``); the apps.yaml section wins where both exist.
`orchestrator.frontdoor.admission` applies it to each inference (docs/oip.md, "Admission").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuprims.modelrepo.config import QueuePolicy, TimeoutAction
from orchestrator.config.schema import AppConfig

#: HTTP codes a refusal may be answered with (Triton's queue policy answers 503 UNAVAILABLE).
REFUSE_STATUSES = (503, 429)


class PriorityError(ValueError):
    """A request's ``priority`` is not one of the app's levels."""


@dataclass(frozen=True)
class AdmissionPolicy:
    """``queue``: Triton's default queue policy; ``priority_levels`` (0: one level for every request)
    with ``default_priority_level`` for a request that gives none (or priority 0); ``refuse_status``:
    the HTTP code of a refusal (gRPC always answers UNAVAILABLE)."""

    queue: QueuePolicy = field(default_factory=QueuePolicy)
    priority_levels: int = 0
    default_priority_level: int = 0
    refuse_status: int = 503

    def __post_init__(self) -> None:
        if self.refuse_status not in REFUSE_STATUSES:
            raise ValueError(f"refuse_status must be one of {REFUSE_STATUSES}, got {self.refuse_status!r}")
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(f"default_priority_level must be 1..{self.priority_levels}, "
                             f"got {self.default_priority_level}")

    @property
    def levels(self) -> int:
        """How many levels requests are counted and admitted by (1 without priority levels)."""
        return max(1, self.priority_levels)

    def level(self, priority: int) -> int:
        """The level (1 highest .. `levels`) of a request asking for ``priority`` (0: the default).

        Without priority levels every request is level 1 whatever it asks. With them, a priority above
        the levels raises PriorityError (Triton clamps it to the default; we refuse it, so a client's
        mistake is seen)."""
        if not self.priority_levels:
            return 1
        if priority == 0:
            return self.default_priority_level
        if not 1 <= priority <= self.priority_levels:
            raise PriorityError(f"priority {priority} is outside this model's levels 1..{self.priority_levels} "
                                "(1 highest; 0 or none: the default level)")
        return priority

    def deadline_us(self, timeout_us: int | None, slo_ms: float) -> int:
        """The time (µs) a request has to be answered in: its ``timeout`` parameter, else the queue
        policy's ``default_timeout_microseconds``, else the app's SLO. Where the policy sets a default
        timeout, a request's own counts only with ``allow_timeout_override`` and only to shorten it
        (Triton's rule)."""
        default = self.queue.default_timeout_us
        if timeout_us:
            if not default:
                return timeout_us
            return min(timeout_us, default) if self.queue.allow_timeout_override else default
        return default or round(slo_ms * 1000)

    @property
    def delay(self) -> bool:
        """``timeout_action: DELAY``: a request predicted late is admitted anyway (not refused)."""
        return self.queue.timeout_action is TimeoutAction.DELAY


def admission_policy(app: AppConfig) -> AdmissionPolicy:
    """The policy of ``app``: its ``admission:`` section, else its model file's ``dynamic_batching``."""
    cfg = app.admission
    if cfg is not None:
        q = cfg.default_queue_policy
        return AdmissionPolicy(QueuePolicy(q.max_queue_size, q.default_timeout_microseconds,
                                           TimeoutAction(q.timeout_action), q.allow_timeout_override),
                               cfg.priority_levels, cfg.default_priority_level, cfg.refuse_status)
    db = app.file.config.dynamic_batching if app.file is not None else None
    if db is None:
        return AdmissionPolicy()
    return AdmissionPolicy(db.default_queue_policy, db.priority_levels, db.default_priority_level)
