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
