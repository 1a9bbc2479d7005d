"""gpuprims orchestrator: runs one node from an apps.yaml.

Modules: `orchestrator.config` (the apps.yaml schema, `load_config`), `orchestrator.messages` and
`orchestrator.control` (the control plane between the orchestrator, its instances and the CLI),
`orchestrator.metrics` (one statistics record per app, Prometheus export). Importing this package
imports none of them, so the CLI starts fast and nothing touches the GPU.
"""

from __future__ import annotations
