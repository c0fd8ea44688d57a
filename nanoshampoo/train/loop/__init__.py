"""The training loop: the ``Trainer`` orchestrator and its evaluation step."""
