"""Checkpoints: the runtime Checkpointer and the durable tier's layout."""
