"""Runnable examples of DistributedShampoo (``python -m
nanoshampoo.optim.shampoo.examples.<name>``)."""
