"""A fleet of gpuprims nodes on a Ray cluster (docs/fleet.md).

Ray core gives membership, failure detection, starting a process on a chosen machine and a
restartable home for the controller; requests never go through Ray. ``config`` (fleet.yaml),
``plan`` (placement, pure), ``agent`` (one per machine, runs the orchestrator), ``routes`` (the
routing table over HTTP), ``controller`` (the
desired state and the failure story), ``cli`` (``gpuprims-fleet``). Only ``controller`` and ``cli``
import ray (the ``fleet`` extra).
"""
