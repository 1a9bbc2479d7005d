"""The orchestrator's typed errors. They cross the node's parts as exceptions and become replies
(``Result(ok=False, message=...)``) only at the control edge."""

from __future__ import annotations


class NodeError(RuntimeError):
    """Base of the node's errors."""


class StartError(NodeError):
    """The node could not start; nothing it started is left running."""


class PlacementError(StartError):
    """The apps cannot be placed as configured (shares, profiles)."""


class SupervisionError(StartError):
    """An instance could not be started or did not become ready."""


class ChangeError(NodeError):
    """A change of GPU% was refused or could not be made; the app keeps its previous share."""


#: A repository call's error kinds (the front door maps them to HTTP codes).
REPOSITORY_ERROR_KINDS = ("invalid", "not_found", "unavailable")


class RepositoryError(Exception):
    """A repository call that cannot be done; ``kind`` is one of :data:`REPOSITORY_ERROR_KINDS`."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in REPOSITORY_ERROR_KINDS:
            raise ValueError(f"unknown repository error kind {kind!r}")
        self.kind = kind
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.kind, str(self)))
