"""The node room: the node and its parts (supervisor, placement, dispatch, changes of share, the model
repository, Param-Share's bookkeeping, CPU overflow, metrics, the monitor, MPS, the launcher)."""
