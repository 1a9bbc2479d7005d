"""The control room: the vocabulary the node's parts, its instances and the CLI share, and the wire
between them (messages, the control channel, an instance's and a holder's spec, errors, logs, the run
directory's records, memory readings, the status text). It imports no other room."""
