"""Hook-ins for training frameworks (optional extras; the core never imports them):
``trainguard.integrations.hf`` (Hugging Face ``transformers.Trainer``, ``pip install
trainguard[hf]``) and ``trainguard.integrations.lightning`` (PyTorch Lightning,
``pip install trainguard[lightning]``)."""
