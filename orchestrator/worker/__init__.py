"""The worker room: an instance process (its entry point, the fork server, the serving loops and the
model runners) and the Param-Share holder process. It never imports the node."""
