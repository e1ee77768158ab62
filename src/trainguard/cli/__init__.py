"""The ``trainguard`` command."""
