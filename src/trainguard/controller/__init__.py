"""The controller: job state machine, node pool, store, HTTP API."""
