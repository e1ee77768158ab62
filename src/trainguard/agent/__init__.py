"""The node agent: reconcile loop, worker supervision, hang watchdog."""
