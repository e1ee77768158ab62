"""Checkpoints: the runtime Checkpointer and the durable tier's layout.

``node_daemon(ckpt_dir)``: a node's checkpoint daemon (ckptd) for this process and its children,
without ``trainguard run`` (``ckptd_client.py``).
"""

from trainguard.checkpoint.ckptd_client import node_daemon

__all__ = ["node_daemon"]
