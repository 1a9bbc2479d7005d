"""gpuprims orchestrator: runs one node from an apps.yaml.

Modules: `orchestrator.config.schema` (the apps.yaml schema, `load_config`), `orchestrator.control.messages` and
`orchestrator.control.channel` (the control plane between the orchestrator, its instances and the CLI),
`orchestrator.node.metrics` (one statistics record per app, Prometheus export). Importing this package
imports none of them, so the CLI starts fast and nothing touches the GPU.
"""

from __future__ import annotations
